"""``E2bSandboxes``: E2B sandboxes as ``SandboxManager`` sessions, scoped by tenant.

Each E2B sandbox is one manager session (``sandbox_session_key`` of a fresh
uuid), acquired at create, suspended at pause (natively on Lambda MicroVMs,
checkpoint-and-destroy elsewhere: the manager's one suspend policy), resumed at
connect (the workspace restored before anything runs) and destroyed at kill or
when its timeout passes (paused instead with ``autoPause``).

The table of sandboxes (tenant, template, envd tokens, metadata, env, timeout,
running or paused) is the registry's E2B table (``registry/e2b.py``), so with a
shared registry every worker serves every sandbox: a worker that did not create
one connects to it through its session record (``SandboxManager.connect``: its
provider reaches it when the workers share the engine, the account, or, for the
local provider, ``SANDCELL_LOCAL_RUNTIME_DIR``). What stays in this process is
the handle to each sandbox it has reached, reopened when the row says the
sandbox was resumed since (``views.SandboxViews``). A paused sandbox's row is kept
in the snapshot store as well (``kept.py``): a registry that lost it (a wiped
Redis) has it rebuilt on the owner's next lookup or listing, and the sandbox
resumes from its checkpoint. The listing is ``listing.py``'s, the network updates
``network.py``'s, snapshots and forks ``copies.py``'s, the timeout sweep
``timeouts.py``'s. Create's ``Idempotency-Key``
is claimed in the registry too (``create_once``): a retry on any worker gets the
first create's sandbox. With an embedded registry the sandboxes end with the
process (``aclose`` kills them); with a distributed one they outlive it, for the
other workers.

Tenants are walls: every lookup by id is scoped by the caller's namespace, and
another tenant's sandbox answers exactly as a missing one. The envd side finds a
sandbox by id and access token together (a wrong token reads as no sandbox).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping

import anyio
import msgspec

from sandcell_protocol import EgressPolicy
from sandcell_protocol.sandbox_messages import MetricsQuery, MetricsSample

from ..errors import SandcellError
from ..handle import SandboxHandle
from ..providers.base import SandboxSpec
from ..registry import E2bSandboxRow, SessionRegistry
from ..runner.sandbox import SandboxRunnerClient
from ..sessions.manager import SandboxManager, sandbox_session_key
from ..snapshots import SnapshotNotFoundError
from .copies import SandboxCopies
from .create_once import check_create_key, create_once
from .errors import UNSAVABLE, E2bError, unsavable
from .history import MetricsHistory, in_range, merge_samples
from .kept import KeptRows
from .listing import SandboxListing
from .network import SandboxNetwork
from .sandbox import E2bSandbox, check_sandbox_id, new_sandbox_id, token_ok, valid_sandbox_id
from .saved import (
    SNAPSHOT_TAG,
    SavedSnapshots,
    SnapshotMeta,
    parse_snapshot_name,
    snapshot_ref,
    team_slug,
)
from .signing import FileSignature, file_signature_ok
from .timeouts import FULL_SWEEP_S, TIMEOUT_PAUSE_ATTEMPTS, TimeoutSweep
from .views import SandboxViews

__all__ = [
    "DEFAULT_TEMPLATES",
    "FULL_SWEEP_S",
    "TIMEOUT_PAUSE_ATTEMPTS",
    "E2bSandbox",
    "E2bSandboxes",
    "check_sandbox_id",
]

log = logging.getLogger(__name__)

_OWNER_LABEL = "sandcell.e2b_sandbox"
DEFAULT_TEMPLATES: Mapping[str, SandboxSpec] = {
    "base": SandboxSpec(),
    "code-interpreter-v1": SandboxSpec(),
}
"""E2B template names served by default, each a sandcell sandbox spec."""


class E2bSandboxes:
    """Create, find, time out, pause, resume and kill E2B sandboxes."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        templates: Mapping[str, SandboxSpec] = DEFAULT_TEMPLATES,
        default_timeout_s: int = 300,
        max_timeout_s: int = 86_400,
        max_running_per_tenant: int = 32,
        max_snapshots_per_tenant: int = 100,
        keep_at_exit: bool = False,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = new_sandbox_id,
        new_token: Callable[[], str] = lambda: secrets.token_urlsafe(32),
    ) -> None:
        self.manager = manager
        self.templates = dict(templates)
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.max_running_per_tenant = max_running_per_tenant
        self.keep_at_exit = keep_at_exit
        self._now = wall_clock
        self._new_id = new_id
        self._new_token = new_token
        self.timeouts = TimeoutSweep(
            lambda: self.registry,
            # Looked up at each call (views is made below; the methods may be wrapped).
            view=lambda row: self.views.view(row),
            pause=lambda sandbox: self.pause(sandbox),
            kill=lambda sandbox: self.kill(sandbox),
            metrics=manager.metrics,
            now=wall_clock,
        )
        self.kept = KeptRows(manager.store)
        self.history = MetricsHistory(manager.store)
        self.snapshots = SavedSnapshots(manager.store, max_per_tenant=max_snapshots_per_tenant)
        # The sandboxes this worker has seen, with the handles it opened.
        self.views = SandboxViews(
            manager,
            spec_of=self._spec,
            kept=self.kept,
            on_forget=self.timeouts.forget,
        )
        self.listing = SandboxListing(lambda: self.registry, kept=self.kept, views=self.views)
        self.network = SandboxNetwork(manager, views=self.views, spec_of=self._spec)
        self.copies = SandboxCopies(
            manager,
            views=self.views,
            snapshots=self.snapshots,
            create=self.create,
            max_count=lambda: self.max_running_per_tenant,
            now=self._now,
        )

    def __repr__(self) -> str:
        return f"E2bSandboxes(local={len(self.views)})"

    @property
    def registry(self) -> SessionRegistry:
        return self.manager.registry

    # -- views -------------------------------------------------------------------------

    def _spec(self, row: E2bSandboxRow) -> SandboxSpec:
        base = self.templates.get(row.template, SandboxSpec())
        return SandboxSpec(
            image=base.image,
            template=base.template,
            turn_timeout_s=base.turn_timeout_s,
            env=base.env,
            egress=row.egress if row.egress is not None else base.egress,
            limits=base.limits,
            labels={**base.labels, _OWNER_LABEL: row.sandbox_id},
        )

    # -- lookups ------------------------------------------------------------------------

    async def get(self, sandbox_id: str, *, owner: str) -> E2bSandbox:
        """``owner``'s sandbox; a 404 for a missing one and another tenant's alike.

        A registry without the row (wiped) has it rebuilt from ``owner``'s kept row.
        Another tenant's sandbox takes that path too (the caller's own prefix is read):
        answered from the registry alone it would come back sooner, and as a 404 where
        a failing store makes a missing one a 5xx, telling that the id exists."""
        row = await self.registry.e2b_sandbox(check_sandbox_id(sandbox_id))
        if row is None:
            await self.views.forget(sandbox_id)
        if row is None or row.namespace != owner:
            row = await self.kept.rebuild(self.registry, sandbox_id, owner=owner)
        if row is None:
            raise E2bError(404, "not_found", f"sandbox {sandbox_id} not found")
        return await self.views.view(row)

    async def running_of(self, owner: str) -> list[E2bSandbox]:
        """``owner``'s running sandboxes, oldest first (reading the running rows only)."""
        rows = await self.registry.e2b_running_of(owner)
        return [await self.views.view(row) for row in rows]

    async def for_envd(
        self,
        sandbox_id: str | None,
        token: str | None,
        *,
        traffic_token: str | None = None,
        signed: FileSignature | None = None,
    ) -> E2bSandbox | None:
        """The sandbox named by a request to one of its ports, with a handle when it runs,
        if ``token`` is its envd access token (or, where allowed, ``traffic_token`` its
        traffic token), or, for a request that sends no token, ``signed`` was made with
        it (a signed file URL; an expired one that matches is a 401 ``E2bError``)."""
        row = None
        if sandbox_id is not None and valid_sandbox_id(sandbox_id):
            row = await self.registry.e2b_sandbox(sandbox_id)
            if row is None:
                await self.views.forget(sandbox_id)
        if signed is not None and not token:
            allowed = file_signature_ok(row, signed, now_s=self._now())
        else:
            allowed = token_ok(row, token, traffic_token)
        if not allowed or row is None:
            return None
        return await self.views.attach(await self.views.view(row))

    async def for_port(
        self, sandbox_id: str | None, traffic_token: str | None
    ) -> E2bSandbox | None:
        """The sandbox named by a request to one of its own servers, with a handle when it
        runs: for anyone if it was created public, else with its traffic token."""
        row = None
        if sandbox_id is not None and valid_sandbox_id(sandbox_id):
            row = await self.registry.e2b_sandbox(sandbox_id)
            if row is None:
                await self.views.forget(sandbox_id)
        tokened = token_ok(row, None, traffic_token or "")
        if row is None or not (row.public_traffic or tokened):
            return None
        return await self.views.attach(await self.views.view(row))

    def known_for_envd(self, sandbox_id: str | None, token: str | None) -> E2bSandbox | None:
        """``for_envd`` from what this worker already read (the RPC handlers' synchronous
        lookup, after the request's ``for_envd`` brought it up to date)."""
        return self.views.known(sandbox_id, token)

    # -- create ---------------------------------------------------------------------------

    def _timeout(self, timeout_s: int | None) -> int:
        value = self.default_timeout_s if timeout_s is None else timeout_s
        if not 0 < value <= self.max_timeout_s:
            raise E2bError(400, "bad_request", f"timeout: must be 1..{self.max_timeout_s} seconds")
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
        if template not in self.templates:
            # A snapshot is a template of its tenant's only: another's reads as unknown.
            source = await self.snapshot_of(owner, template)
            if source is None or source.template not in self.templates:
                raise unknown
            template = source.template
            reported = (source.snapshot_id, source.name)
        if fork_of is not None:
            reported = (fork_of.template_id, fork_of.alias)
        timeout = self._timeout(timeout_s)

        async def make(sandbox_id: str | None = None) -> E2bSandbox:
            await self._check_room(owner)
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
            self.registry, owner=owner, key=idempotency_key, make=make, view=self.views.view
        )

    async def _check_room(self, owner: str) -> None:
        limit = self.max_running_per_tenant
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
        sandbox = E2bSandbox(row=row, spec=self._spec(row))
        handle = await self.manager.acquire(row.session_id, sandbox.spec, owner=owner)
        try:
            if source is not None:
                # Before the row is added: nobody reaches the sandbox before its files.
                key = self.snapshots.data_key(owner, source.snapshot_id)
                await self.manager.restore_workspace(
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
        self.views.add(sandbox)
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

    # -- timeouts ---------------------------------------------------------------------------

    async def set_timeout(self, sandbox: E2bSandbox, timeout_s: int) -> None:
        """The sandbox now ends ``timeout_s`` seconds from now (shorter or longer)."""
        end = self._now() + self._timeout(timeout_s)
        await self.views.change(sandbox, lambda row: msgspec.structs.replace(row, end_at_s=end))

    async def expire(self) -> int:
        """Kill (or, with ``autoPause``, pause) running sandboxes past their end; how
        many (``timeouts.TimeoutSweep.expire``)."""
        return await self.timeouts.expire()

    # -- network ----------------------------------------------------------------------------

    async def set_network(self, sandbox: E2bSandbox, policy: EgressPolicy | None) -> None:
        """Replace the sandbox's egress policy (``network.SandboxNetwork.replace``)."""
        await self.network.replace(sandbox, policy)

    # -- pause, connect, kill ------------------------------------------------------------

    async def pause(self, sandbox: E2bSandbox) -> bool:
        """Suspend a running sandbox (its workspace and metrics samples are saved);
        False if already paused."""
        await self.views.attach(sandbox)  # takes the lock itself: before it is held
        async with sandbox.lock:
            await self.views.refresh(sandbox)
            if sandbox.state == "paused":
                return False
            await self._keep_metrics(sandbox)
            # Suspended first: if that fails the sandbox runs on, reachable as before.
            try:
                await self.manager.suspend(sandbox.session_id)
            except UNSAVABLE as exc:
                # The tenant's own files: a 4xx naming why, not the store's 500.
                raise unsavable(
                    sandbox.sandbox_id,
                    exc,
                    what="a pause may save",
                    most_bytes=self.manager.persistence.max_bytes,
                    after="; it runs on",
                ) from None
            await self.views.close_handle(sandbox)
            await self.views.change(
                sandbox, lambda row: msgspec.structs.replace(row, state="paused")
            )
        log.info("e2b sandbox %s paused", sandbox.sandbox_id)
        return True

    async def connect(self, sandbox: E2bSandbox, *, timeout_s: int | None) -> E2bSandbox:
        """Resume a paused sandbox (workspace restored first); a running one's timeout is
        extended when ``timeout_s`` ends later than its current end."""
        async with sandbox.lock:
            await self.views.refresh(sandbox)
            end = self._now() + self._timeout(timeout_s)
            if sandbox.state == "paused":
                await self._check_room(sandbox.owner)
                # ``adopt``: a row rebuilt after a wipe has no session record left; its
                # newest checkpoint is the workspace it was paused with.
                attached = await self.manager.resume(sandbox.session_id, sandbox.spec, adopt=True)
                handle = attached.handle
                # What the runner enforces: the spec's if it was launched for this resume;
                # unknown if it was resumed in place (a MicroVM keeps the policy it was
                # suspended with) or was running (a resume that never wrote the row).
                enforced = self.network.egress(sandbox.row) if attached.launched else None

                async def align(row: E2bSandboxRow) -> None:
                    # An update that landed since the spec was read (on any worker) left
                    # this runner to us (``network``'s docstring says why).
                    nonlocal enforced
                    wanted = self.network.egress(row)
                    if wanted != enforced:
                        await self.manager.apply_egress(handle, wanted)
                        enforced = wanted

                try:
                    await self.views.change(
                        sandbox,
                        lambda row: msgspec.structs.replace(
                            row, state="running", end_at_s=end, resumes=row.resumes + 1
                        ),
                        prepare=align,
                    )
                except BaseException:
                    with contextlib.suppress(SandcellError):
                        await handle.close()
                    raise
                sandbox.handle = handle
                sandbox.runner = SandboxRunnerClient.for_handle(handle)
                sandbox.handle_resumes = sandbox.row.resumes
                log.info("e2b sandbox %s resumed", sandbox.sandbox_id)
            elif timeout_s is not None and end > sandbox.end_at_s:
                await self.views.change(
                    sandbox,
                    lambda row: msgspec.structs.replace(row, end_at_s=max(end, row.end_at_s)),
                )
        return sandbox

    async def snapshot(
        self, sandbox: E2bSandbox, *, name: str | None = None, tag: str = SNAPSHOT_TAG
    ) -> SnapshotMeta:
        """Save a running sandbox's workspace as a snapshot (``copies.SandboxCopies``)."""
        return await self.copies.snapshot(sandbox, name=name, tag=tag)

    async def snapshot_of(self, owner: str, template: str) -> SnapshotMeta | None:
        """``owner``'s snapshot a create's ``templateID`` names: a snapshot id
        (``<id>:default``, ``<id>``) or a name (``[<slug>/]<name>[:<tag>]``, the newest
        under it; tag ``default`` unless given); None for none, another namespace's
        name included (it is another tenant's, so unknown). A templateID that is no
        E2B name at all is E2B's 400."""
        bare = snapshot_ref(template)
        meta = None if bare is None else await self.snapshots.get(owner, bare)
        if meta is not None:
            return meta
        try:
            name = parse_snapshot_name(template)
        except ValueError as exc:
            raise E2bError(400, "bad_request", f"Invalid template reference: {exc}") from None
        if name.namespace is not None and name.namespace != team_slug(owner):
            return None
        found = await self.snapshots.named(owner, name.alias, name.tag or SNAPSHOT_TAG)
        return await self.snapshots.get(owner, found[0].snapshot_id) if found else None

    async def fork(
        self, sandbox: E2bSandbox, *, timeout_s: int, count: int
    ) -> list[E2bSandbox | E2bError]:
        """E2B's fork: a snapshot, then ``count`` creates from it (``copies.SandboxCopies``)."""
        self._timeout(timeout_s)
        return await self.copies.fork(sandbox, timeout_s=timeout_s, count=count)

    async def metrics(self, sandbox: E2bSandbox, query: MetricsQuery) -> list[MetricsSample]:
        """The samples in the query's range, oldest first: those its pauses kept
        (``history.MetricsHistory``) and, while it runs, its runner's ring."""
        kept: list[MetricsSample] = []
        if sandbox.row.resumes or sandbox.state == "paused":
            # Only a sandbox that was ever paused has kept samples: no store read else.
            kept = in_range(await self.history.read(sandbox.owner, sandbox.sandbox_id), query)
        if sandbox.state != "running":
            return kept
        runner = (await self.views.attach(sandbox)).runner
        if runner is None:
            return kept  # a runner this worker's provider cannot reach (logged by attach)
        return merge_samples(kept, (await runner.metrics(query)).samples)

    async def _keep_metrics(self, sandbox: E2bSandbox) -> None:
        """Before a pause: the runner's samples into the kept ones (best effort: a
        runner or store that fails loses them, never the pause)."""
        runner = sandbox.runner
        if runner is None:
            return
        try:
            samples = (await runner.metrics(MetricsQuery())).samples
        except SandcellError as exc:
            log.warning("e2b sandbox %s: metrics not kept: %s", sandbox.sandbox_id, exc)
            return
        await self.history.keep(sandbox.owner, sandbox.sandbox_id, samples)

    async def kill(self, sandbox: E2bSandbox) -> None:
        """Destroy the sandbox, its checkpoints, its kept row and its row (idempotent)."""
        with anyio.CancelScope(shield=True):
            async with sandbox.lock:
                if sandbox.gone:
                    return
                # The kept row first: once it is gone no lookup rebuilds the row. A
                # paused sandbox's kill fails when the store does, with nothing removed
                # yet; a running one has a kept row only where a delete failed before,
                # and is killed all the same (a timeout kill in an S3 outage). Then
                # the row: from here on no worker finds the sandbox.
                if sandbox.state == "paused":
                    await self.kept.drop(sandbox.owner, sandbox.sandbox_id)
                else:
                    await self.kept.drop_quietly(sandbox.owner, sandbox.sandbox_id)
                await self.registry.remove_e2b_sandbox(sandbox.sandbox_id)
                await self.views.forget(sandbox.sandbox_id)
                if sandbox.row.resumes or sandbox.state == "paused":
                    await self.history.drop(sandbox.owner, sandbox.sandbox_id)
                try:
                    await self.manager.destroy(sandbox.session_id)
                except SandcellError as exc:
                    log.warning("e2b sandbox %s: destroy failed: %s", sandbox.sandbox_id, exc)
        log.info("e2b sandbox %s killed", sandbox.sandbox_id)

    async def _discard(self, handle: SandboxHandle, session_id: str) -> None:
        with contextlib.suppress(SandcellError):
            await handle.close()
        with contextlib.suppress(SandcellError):
            await self.manager.destroy(session_id)

    async def aclose(self) -> None:
        """Close this worker's handles; kill every sandbox unless they outlive it
        (``keep_at_exit``: a shared registry, where other workers serve them)."""
        if not self.keep_at_exit:
            with contextlib.suppress(SandcellError):
                for row in await self.registry.e2b_sandboxes():
                    await self.kill(await self.views.view(row))
        for sandbox in self.views.all():
            await self.views.close_handle(sandbox)
        self.views.clear()
