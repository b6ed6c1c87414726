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
resumes from its checkpoint. Create is ``creation.py``'s, pause and connect
``pausing.py``'s, metrics ``metrics.py``'s, the listing ``listing.py``'s, the
network updates ``network.py``'s, snapshots and forks ``copies.py``'s, the timeout
sweep ``timeouts.py``'s; this module holds them together, with the lookups and kill.
Create's ``Idempotency-Key`` is claimed in the registry too (``create_once``): a
retry on any worker gets the first create's sandbox. With an embedded registry
the sandboxes end with the process (``aclose`` kills them); with a distributed one
they outlive it, for the other workers.

Tenants are walls: every lookup by id is scoped by the caller's namespace, and
another tenant's sandbox answers exactly as a missing one. The envd side finds a
sandbox by id and access token together (a wrong token reads as no sandbox).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping

import anyio
import msgspec

from sandcell_protocol import EgressPolicy
from sandcell_protocol.sandbox_messages import MetricsQuery, MetricsSample

from ..errors import SandcellError
from ..providers.base import SandboxSpec
from ..registry import E2bSandboxRow, SessionRegistry
from ..sessions.manager import SandboxManager
from .copies import SandboxCopies
from .creation import SandboxCreation
from .errors import E2bError
from .history import MetricsHistory
from .kept import KeptRows
from .listing import SandboxListing
from .metrics import SandboxMetrics
from .network import SandboxNetwork
from .pausing import SandboxPauses
from .sandbox import E2bSandbox, check_sandbox_id, new_sandbox_id, token_ok, valid_sandbox_id
from .saved import SNAPSHOT_TAG, SavedSnapshots, SnapshotMeta
from .signing import FileSignature, file_signature_ok
from .timeouts import FULL_SWEEP_S, TIMEOUT_PAUSE_ATTEMPTS, TimeoutSweep
from .views import SandboxViews

__all__ = [
    "DEFAULT_TEMPLATES",
    "FULL_SWEEP_S",
    "RETIRED_SWEEP_S",
    "TIMEOUT_PAUSE_ATTEMPTS",
    "E2bSandbox",
    "E2bSandboxes",
    "check_sandbox_id",
]

log = logging.getLogger(__name__)

RETIRED_SWEEP_S = 3600.0
"""How often a worker's timeout sweep also deletes retired metrics past retention."""
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
        self.history = MetricsHistory(manager.store, wall_clock=wall_clock)
        self._retired_sweep_at = 0.0
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
        self.creation = SandboxCreation(
            manager,
            templates=self.templates,
            spec_of=self._spec,
            views=self.views,
            snapshots=self.snapshots,
            default_timeout_s=lambda: self.default_timeout_s,
            max_timeout_s=lambda: self.max_timeout_s,
            max_running=lambda: self.max_running_per_tenant,
            now=self._now,
            new_id=self._new_id,
            new_token=self._new_token,
        )
        self.samples = SandboxMetrics(self.history, views=self.views)
        self.pauses = SandboxPauses(
            manager,
            views=self.views,
            network=self.network,
            creation=self.creation,
            metrics=self.samples,
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
        return self.creation.timeout(timeout_s)

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
        """Acquire a sandbox for ``owner`` from ``template``: a served template or one
        of ``owner``'s snapshots (``creation.SandboxCreation.create``)."""
        return await self.creation.create(
            owner=owner,
            template=template,
            timeout_s=timeout_s,
            metadata=metadata,
            env=env,
            auto_pause=auto_pause,
            idempotency_key=idempotency_key,
            egress=egress,
            public_traffic=public_traffic,
            fork_of=fork_of,
        )

    # -- timeouts ---------------------------------------------------------------------------

    async def set_timeout(self, sandbox: E2bSandbox, timeout_s: int) -> None:
        """The sandbox now ends ``timeout_s`` seconds from now (shorter or longer)."""
        end = self._now() + self._timeout(timeout_s)
        await self.views.change(sandbox, lambda row: msgspec.structs.replace(row, end_at_s=end))

    async def expire(self) -> int:
        """Kill (or, with ``autoPause``, pause) running sandboxes past their end; how
        many (``timeouts.TimeoutSweep.expire``). Once every ``RETIRED_SWEEP_S``, every
        tenant's retired metrics past their retention are deleted too."""
        ended = await self.timeouts.expire()
        if self._now() >= self._retired_sweep_at:
            self._retired_sweep_at = self._now() + RETIRED_SWEEP_S
            try:
                await self.history.reap_expired()
            except SandcellError as exc:
                log.warning("e2b: retired metrics not reaped: %s", exc)
        return ended

    # -- network ----------------------------------------------------------------------------

    async def set_network(self, sandbox: E2bSandbox, policy: EgressPolicy | None) -> None:
        """Replace the sandbox's egress policy (``network.SandboxNetwork.replace``)."""
        await self.network.replace(sandbox, policy)

    # -- pause, connect, kill ------------------------------------------------------------

    async def pause(self, sandbox: E2bSandbox) -> bool:
        """Suspend a running sandbox (``pausing.SandboxPauses.pause``); False if already
        paused."""
        return await self.pauses.pause(sandbox)

    async def connect(self, sandbox: E2bSandbox, *, timeout_s: int | None) -> E2bSandbox:
        """Resume a paused sandbox, or extend a running one's timeout
        (``pausing.SandboxPauses.connect``)."""
        return await self.pauses.connect(sandbox, timeout_s=timeout_s)

    async def snapshot(
        self, sandbox: E2bSandbox, *, name: str | None = None, tag: str = SNAPSHOT_TAG
    ) -> SnapshotMeta:
        """Save a running sandbox's workspace as a snapshot (``copies.SandboxCopies``)."""
        return await self.copies.snapshot(sandbox, name=name, tag=tag)

    async def snapshot_of(self, owner: str, template: str) -> SnapshotMeta | None:
        """``owner``'s snapshot a create's ``templateID`` names, None for none
        (``creation.SandboxCreation.snapshot_of``)."""
        return await self.creation.snapshot_of(owner, template)

    async def fork(
        self, sandbox: E2bSandbox, *, timeout_s: int, count: int
    ) -> list[E2bSandbox | E2bError]:
        """E2B's fork: a snapshot, then ``count`` creates from it (``copies.SandboxCopies``)."""
        self._timeout(timeout_s)
        return await self.copies.fork(sandbox, timeout_s=timeout_s, count=count)

    async def metrics(self, sandbox: E2bSandbox, query: MetricsQuery) -> list[MetricsSample]:
        """The samples in the query's range, oldest first (``metrics.SandboxMetrics``)."""
        return await self.samples.read(sandbox, query)

    async def killed_metrics(
        self, owner: str, sandbox_id: str, query: MetricsQuery
    ) -> list[MetricsSample]:
        """The samples ``owner``'s killed sandbox retired, in the query's range (none
        for an id ``owner`` never had: ``metrics.SandboxMetrics.read_killed``)."""
        return await self.samples.read_killed(owner, sandbox_id, query)

    async def kill(self, sandbox: E2bSandbox) -> None:
        """Destroy the sandbox, its checkpoints, its kept row and its row (idempotent);
        its metrics samples are retired first (``history.MetricsHistory.retire``)."""
        with anyio.CancelScope(shield=True):
            async with sandbox.lock:
                if sandbox.gone:
                    return
                # Its samples outlive it, as E2B's (read while its runner still runs).
                await self.samples.retire(sandbox)
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
