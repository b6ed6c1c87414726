"""``SandboxCreation``: E2B's create, from a served template or a tenant's snapshot.

A create acquires a ``SandboxManager`` session for a fresh row (a new sandbox id and
envd tokens), restores a snapshot's workspace into it first when the template names
one, reads the runner's limits once (so listings read rows only) and adds the row;
the tenant's running sandboxes are capped. An ``Idempotency-Key`` is claimed in the
registry (``create_once``): a retry on any worker gets the first create's sandbox.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping

import anyio
import msgspec

from sandcell_protocol import EgressPolicy
from sandcell_protocol.sandbox_messages import MetricsQuery

from ..errors import SandcellError
from ..handle import SandboxHandle
from ..providers.base import SandboxSpec
from ..registry import E2bSandboxRow, SessionRegistry
from ..runner.sandbox import SandboxRunnerClient
from ..sessions.manager import SandboxManager, sandbox_session_key
from ..snapshots import SnapshotNotFoundError
from .create_once import check_create_key, create_once
from .errors import E2bError
from .sandbox import E2bSandbox
from .saved import (
    SNAPSHOT_TAG,
    SavedSnapshots,
    SnapshotMeta,
    parse_snapshot_name,
    snapshot_ref,
    team_slug,
)
from .views import SandboxViews

__all__ = ["SandboxCreation"]

log = logging.getLogger(__name__)


class SandboxCreation:
    """Create E2B sandboxes for tenants, each tenant's running ones capped."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        templates: Mapping[str, SandboxSpec],
        spec_of: Callable[[E2bSandboxRow], SandboxSpec],
        views: SandboxViews,
        snapshots: SavedSnapshots,
        default_timeout_s: Callable[[], int],
        max_timeout_s: Callable[[], int],
        max_running: Callable[[], int],
        now: Callable[[], float],
        new_id: Callable[[], str],
        new_token: Callable[[], str],
    ) -> None:
        self._manager = manager
        self._templates = templates
        self._spec_of = spec_of
        self._views = views
        self._snapshots = snapshots
        self._default_timeout_s = default_timeout_s
        self._max_timeout_s = max_timeout_s
        self._max_running = max_running
        self._now = now
        self._new_id = new_id
        self._new_token = new_token

    @property
    def registry(self) -> SessionRegistry:
        return self._manager.registry

    def timeout(self, timeout_s: int | None) -> int:
        """``timeout_s`` (the default for None) if in range, else E2B's 400."""
        value = self._default_timeout_s() if timeout_s is None else timeout_s
        if not 0 < value <= self._max_timeout_s():
            raise E2bError(
                400, "bad_request", f"timeout: must be 1..{self._max_timeout_s()} seconds"
            )
        return value

    async def create(
        self,
        *,
        owner: str,
        template: str,
        timeout_s: int | None,
        metadata: Mapping[str, str],
        env: Mapping[str, str],
        auto_pause: bool,
        idempotency_key: str | None = None,
        egress: EgressPolicy | None = None,
        public_traffic: bool = False,
        fork_of: E2bSandboxRow | None = None,
    ) -> E2bSandbox:
        """Acquire a sandbox for ``owner`` from ``template`` (a retry with the same
        ``idempotency_key``, on any worker, answers the sandbox the first call made);
        ``public_traffic``: its ports answer without the traffic token. A sandbox made
        from a snapshot reports the snapshot as its ``templateID`` (and its name as
        ``alias``), as E2B does; a fork (``fork_of``: its source) reports its source's,
        as E2B's fork, a resume of the source's snapshot, does."""
        check_create_key(idempotency_key)
        source: SnapshotMeta | None = None
        reported: tuple[str | None, str | None] = (None, None)
        unknown = E2bError(404, "not_found", f"template {template[:80]!r} not found")
        if template not in self._templates:
            # A snapshot is a template of its tenant's only: another's reads as unknown.
            source = await self.snapshot_of(owner, template)
            if source is None or source.template not in self._templates:
                raise unknown
            template = source.template
            reported = (source.snapshot_id, source.name)
        if fork_of is not None:
            reported = (fork_of.template_id, fork_of.alias)
        timeout = self.timeout(timeout_s)

        async def make(sandbox_id: str | None = None) -> E2bSandbox:
            await self.check_room(owner)
            # Once a sandbox is being made, it is made and registered even if the caller
            # goes away: a half-made one would be nobody's to destroy.
            with anyio.CancelScope(shield=True):
                try:
                    made = await self._create(
                        owner=owner,
                        template=template,
                        timeout_s=timeout,
                        metadata=metadata,
                        env=env,
                        auto_pause=auto_pause,
                        egress=egress,
                        public_traffic=public_traffic,
                        sandbox_id=sandbox_id,
                        source=source,
                        reported=reported,
                    )
                except SnapshotNotFoundError:
                    if source is None:
                        raise
                    # The snapshot was deleted since its meta was read (a delete takes
                    # the meta, then the workspace): the create answers as after it.
                    raise unknown from None
            return made  # after the block: a cancel scope may end it (mypy needs it here)

        if idempotency_key is None:
            return await make()
        return await create_once(
            self.registry, owner=owner, key=idempotency_key, make=make, view=self._views.view
        )

    async def check_room(self, owner: str) -> None:
        limit = self._max_running()
        # The count reads no row; it can run high (an index entry an older orchestrator
        # left wrong, an unreadable row), never low, so only a refusal needs the rows,
        # whose read also puts such entries right.
        if await self.registry.e2b_running_count(owner) < limit:
            return
        if len(await self.registry.e2b_running_of(owner)) >= limit:
            raise E2bError(
                429,
                "busy",
                f"at most {limit} running sandboxes per tenant; kill or pause one first",
            )

    async def _create(
        self,
        *,
        owner: str,
        template: str,
        timeout_s: int,
        metadata: Mapping[str, str],
        env: Mapping[str, str],
        auto_pause: bool,
        egress: EgressPolicy | None = None,
        public_traffic: bool = False,
        sandbox_id: str | None = None,
        source: SnapshotMeta | None = None,
        reported: tuple[str | None, str | None] = (None, None),
    ) -> E2bSandbox:
        now = self._now()
        row = E2bSandboxRow(
            sandbox_id=sandbox_id or self._new_id(),
            namespace=owner,
            template=template,
            session_id=sandbox_session_key(str(uuid.uuid4())),
            access_token=self._new_token(),
            traffic_token=self._new_token(),
            metadata=dict(metadata),
            env=dict(env),
            egress=egress,
            started_at_s=now,
            end_at_s=now + timeout_s,
            auto_pause=auto_pause,
            state="running",
            public_traffic=public_traffic,
            template_id=reported[0],
            alias=reported[1],
        )
        sandbox = E2bSandbox(row=row, spec=self._spec_of(row))
        handle = await self._manager.acquire(row.session_id, sandbox.spec, owner=owner)
        try:
            if source is not None:
                # Before the row is added: nobody reaches the sandbox before its files.
                key = self._snapshots.data_key(owner, source.snapshot_id)
                await self._manager.restore_workspace(
                    row.session_id, handle, key, taken_of=source.session_id
                )
            row = sandbox.row = await self._with_limits(row, handle)
            added = await self.registry.add_e2b_sandbox(row)
        except BaseException:
            await self._discard(handle, row.session_id)
            raise
        if not added:
            await self._discard(handle, row.session_id)
            raise E2bError(409, "session_conflict", "sandbox id taken; create again")
        sandbox.handle = handle
        sandbox.runner = SandboxRunnerClient.for_handle(handle)
        self._views.add(sandbox)
        log.info("e2b sandbox %s created from template %s", row.sandbox_id, template)
        return sandbox

    @staticmethod
    async def _with_limits(row: E2bSandboxRow, handle: SandboxHandle) -> E2bSandboxRow:
        """``row`` with its runner's limits (E2B's ``cpuCount``, ``memoryMB``,
        ``diskSizeMB``), as the runner's metrics sample reads them: the same figures
        ``get_metrics`` answers. One runner call at create, so listings read rows only;
        a runner that cannot say leaves them unknown (0), and the create goes on."""
        try:
            samples = (await SandboxRunnerClient.for_handle(handle).metrics(MetricsQuery())).samples
        except SandcellError as exc:
            log.warning("e2b sandbox %s: its limits are unknown: %s", row.sandbox_id, exc)
            return row
        if not samples:
            return row
        last = samples[-1]
        return msgspec.structs.replace(
            row,
            cpu_count=last.cpu_count,
            memory_mib=last.mem_total_bytes >> 20,
            disk_mib=last.disk_total_bytes >> 20,
        )

    async def snapshot_of(self, owner: str, template: str) -> SnapshotMeta | None:
        """``owner``'s snapshot a create's ``templateID`` names: a snapshot id
        (``<id>:default``, ``<id>``) or a name (``[<slug>/]<name>[:<tag>]``, the newest
        under it; tag ``default`` unless given); None for none, another namespace's
        name included (it is another tenant's, so unknown). A templateID that is no
        E2B name at all is E2B's 400."""
        bare = snapshot_ref(template)
        meta = None if bare is None else await self._snapshots.get(owner, bare)
        if meta is not None:
            return meta
        try:
            name = parse_snapshot_name(template)
        except ValueError as exc:
            raise E2bError(400, "bad_request", f"Invalid template reference: {exc}") from None
        if name.namespace is not None and name.namespace != team_slug(owner):
            return None
        found = await self._snapshots.named(owner, name.alias, name.tag or SNAPSHOT_TAG)
        return await self._snapshots.get(owner, found[0].snapshot_id) if found else None

    async def _discard(self, handle: SandboxHandle, session_id: str) -> None:
        with contextlib.suppress(SandcellError):
            await handle.close()
        with contextlib.suppress(SandcellError):
            await self._manager.destroy(session_id)
