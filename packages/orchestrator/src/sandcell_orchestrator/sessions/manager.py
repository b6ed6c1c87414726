"""``SandboxManager``: the one sandbox lifecycle.

It is the only code that creates, connects, checkpoints, restores, suspends,
resumes, destroys and sweeps sandboxes, and the only writer of registry rows.
Everything works on runtime-session ids (``rt_…``); app sandboxes name theirs
``sandbox_session_key(uuid)``. Every API surface (``ExecutionService``'s turns,
app instances, ``sandcell serve``) calls it:

    async with manager.hold(session_id) as hold:       # lock + this hold's generation
        attached = await manager.attach(hold, spec)     # reuse, or launch + restore first
        ...                                             # run things in attached.handle
        await manager.checkpoint(hold, attached)        # fenced at the store and the registry

A hold takes the session's lock, then its own generation (``next_generation``),
so no two holders ever share one, even when the second reuses the first's live
sandbox. The generation fences both writes: the checkpoint object's key is the
generation's own (``checkpoint_key``), and the registry record pointing at it is
written only while the lock token and the generation are current. A holder that
lost its lock can still upload, but only under its own old key, which nothing
points at; ``Sweeper`` collects it later.

The parts it is made of, each its own module: ``Holds`` (lock and generation),
``Attacher`` (which sandbox serves a hold, restored first), ``TurnCommits`` (the
fenced writes that commit a turn), ``Teardown`` (suspend, one policy on every
provider; destroy; this process's sandboxes at exit), ``SessionRecords`` (the one row writer),
``Sandboxes`` (the provider side), ``Persistence`` (checkpoints in the store),
``StatelessAnswers`` (keyed stateless runs' answers in the store) and ``Sweeper``.
This module wires them and holds the lifecycle by session id.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from sandcell_protocol import EgressPolicy, EgressStatus

from ..config import Budgets
from ..errors import SandboxNotFoundError
from ..handle import SandboxHandle
from ..metrics import Metrics
from ..providers.base import SandboxProvider, SandboxSpec
from ..registry import IdempotentAnswer, SessionRecord, SessionRegistry
from ..snapshots import SnapshotInfo, SnapshotStore
from .attach import Attacher
from .commits import TurnCommits
from .holds import Holds
from .persistence import Persistence, PersistentWorkspace, TurnResult
from .records import SessionRecords
from .sandboxes import Attached, Hold, Sandboxes, rebind, sandbox_session_key
from .stateless_answers import StatelessAnswers
from .sweep import Sweeper
from .teardown import Teardown

__all__ = ["Attached", "Hold", "SandboxManager", "rebind", "sandbox_session_key"]


class SandboxManager:
    """Provider-neutral lifecycle of sandboxes, recorded in the session registry."""

    def __init__(
        self,
        provider: SandboxProvider,
        registry: SessionRegistry,
        store: SnapshotStore,
        *,
        budgets: Budgets | None = None,
        checkpoint_max_bytes: int = 1 << 30,
        checkpoint_grace_s: float = 600.0,
        metrics: Metrics | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.provider = provider
        self._registry = registry
        self.budgets = budgets or Budgets()
        self.metrics = metrics or Metrics()
        self.persistence = Persistence(
            store, max_bytes=checkpoint_max_bytes, grace_s=checkpoint_grace_s, wall_clock=wall_clock
        )
        # Kept for the checkpoints' grace, as a keyed session turn's answer object is:
        # only a registry wiped within it needs them.
        self.stateless_answers = StatelessAnswers(
            store, grace_s=checkpoint_grace_s, wall_clock=wall_clock
        )
        self.sandboxes = Sandboxes(provider, budgets=self.budgets, metrics=self.metrics)
        self.records = SessionRecords(registry, provider_name=provider.name, wall_clock=wall_clock)
        self.holds = Holds(
            registry,
            self.persistence,
            # Not the turn's length: the holder renews the lock while the turn runs.
            lock_ttl_ms=math.ceil(self.budgets.lock_ttl_s * 1000),
            metrics=self.metrics,
            wall_clock=wall_clock,
        )
        self.attacher = Attacher(
            provider,
            self.sandboxes,
            self.records,
            self.persistence,
            budgets=self.budgets,
            metrics=self.metrics,
        )
        self.commits = TurnCommits(
            registry,
            self.records,
            self.persistence,
            budgets=self.budgets,
            metrics=self.metrics,
            wall_clock=wall_clock,
        )
        self.teardown = Teardown(
            provider, self.sandboxes, self.records, self.persistence, self.commits, self.holds
        )
        self.sweeper = Sweeper(self)
        self._now = wall_clock

    def __repr__(self) -> str:
        return f"SandboxManager(provider={self.provider.name!r})"

    @property
    def store(self) -> SnapshotStore:
        return self.persistence.store

    @property
    def registry(self) -> SessionRegistry:
        """The session registry every part writes through."""
        return self._registry

    @registry.setter
    def registry(self, registry: SessionRegistry) -> None:
        # Replaced on a live manager (a test's fault-injecting view): every part uses it.
        self._registry = registry
        self.records.registry = registry
        self.holds.registry = registry
        self.commits.registry = registry

    @property
    def lock_ttl_ms(self) -> int:
        """The session lock's TTL (a setting; tests shorten it on a live manager)."""
        return self.holds.lock_ttl_ms

    @lock_ttl_ms.setter
    def lock_ttl_ms(self, value: int) -> None:
        self.holds.lock_ttl_ms = value

    # -- holding, attaching (``Holds``, ``Attacher``) ---------------------------------

    def hold(self, session_id: str, *, wait_ms: int = 0) -> AbstractAsyncContextManager[Hold]:
        """Hold the session (its lock, renewed; ``LockLostError`` out if lost) and a
        generation of its own; ``SessionBusyError`` if another holder has it."""
        return self.holds.hold(session_id, wait_ms=wait_ms)

    async def attach(self, hold: Hold, spec: SandboxSpec, *, verify: bool = True) -> Attached:
        """The session's sandbox: the live one, a natively resumed one, or a new one
        restored from the current checkpoint before anything runs (``Attacher.attach``).

        ``verify=False``: a live sandbox is used without a ``/health`` check first.
        """
        return await self.attacher.attach(hold, spec, verify=verify)

    # -- checkpoint, recycle ----------------------------------------------------------

    async def checkpoint(
        self,
        hold: Hold,
        attached: Attached,
        *,
        workspace: PersistentWorkspace | None = None,
        answer: IdempotentAnswer | None = None,
        turn_result: TurnResult | None = None,
    ) -> SnapshotInfo:
        """Save the sandbox's workspace (it keeps running) and point the record at it,
        fenced; ``answer`` is stored by that same write, ``turn_result`` saved with the
        object before it (``TurnCommits.checkpoint``)."""
        return await self.commits.checkpoint(
            hold, attached, workspace=workspace, answer=answer, turn_result=turn_result
        )

    async def open_turn(self, hold: Hold) -> None:
        """Record that a turn's job is about to run in the held sandbox (``turn_open``):
        until the turn closes, no later holder reuses that sandbox."""
        await self.commits.open_turn(hold)

    async def close_turn(
        self, hold: Hold, *, unsaved: bool = False, answer: IdempotentAnswer | None = None
    ) -> None:
        """Record that the held turn ended, with nothing uncommitted or (``unsaved``) with
        acknowledged work no checkpoint has; ``answer`` is stored by that same write."""
        await self.commits.close_turn(hold, unsaved=unsaved, answer=answer)

    def may_have_forgotten(self, hold: Hold) -> bool:
        """Whether the registry may have lost a keyed turn's answer for the held session
        (``TurnCommits.may_have_forgotten``)."""
        return self.commits.may_have_forgotten(hold)

    async def saved_answer(self, hold: Hold, turn_key: str) -> bytes | None:
        """A keyed turn's result if the store says it is applied in the held session
        (``TurnCommits.saved_answer``); None: run it."""
        return await self.commits.saved_answer(hold, turn_key)

    async def save_answer(self, session_id: str, turn_key: str, body: bytes) -> None:
        """Store a committed keyed turn's result by its key (``TurnCommits.save_answer``)."""
        await self.commits.save_answer(session_id, turn_key, body)

    async def commit_answer(self, hold: Hold, answer: IdempotentAnswer | None) -> None:
        """Store a keyed turn's ``answer`` with a fenced write of the held record, as it
        stands (``TurnCommits.commit_answer``)."""
        await self.commits.commit_answer(hold, answer)

    async def recycle(self, hold: Hold, attached: Attached) -> None:
        """Destroy a sandbox that may be dirty (a job may still run in it); never reuse it."""
        self.metrics.inc("sandcell_fallbacks_total", reason="recycled")
        await self.park(hold, attached)

    async def park(self, hold: Hold, attached: Attached) -> None:
        """Destroy the session's sandbox and mark its row suspended, still holding it.

        The next holder restores the current checkpoint into a new sandbox. A
        process whose sandboxes die with it parks them before it lets go of the
        session, so no other process reuses one that is about to vanish.
        """
        self.sandboxes.release(hold.session_id)
        await self.sandboxes.shielded(self.attacher.retire(hold, attached.handle))

    async def touch(self, session_id: str) -> None:
        """Record that the session was used now (the idle sweeper reads it)."""
        await self.registry.touch(session_id, at_s=self._now())

    # -- one-shot sandboxes -------------------------------------------------------------

    async def launch(self, spec: SandboxSpec) -> SandboxHandle:
        """A new sandbox for one stateless job (no registry row): within the budgets."""
        return await self.sandboxes.launch(spec)

    async def discard(self, handle: SandboxHandle) -> None:
        """Close and destroy a sandbox, to the end even when the caller is cancelled."""
        await self.sandboxes.discard(handle)

    # -- sessions by id ----------------------------------------------------------------

    async def acquire(self, session_id: str, spec: SandboxSpec, *, owner: str) -> SandboxHandle:
        """Launch and register a sandbox for a new session (the caller owns the handle).

        If registering fails, the new sandbox is destroyed, not orphaned.
        """
        async with self.hold(session_id) as hold:
            return await self.attacher.acquire(hold, spec, owner=owner)

    async def connect(self, session_id: str) -> SandboxHandle:
        """A handle to an active sandbox; ``SandboxNotFoundError`` if suspended or gone."""
        record = await self.registry.get(session_id)
        if record is None or record.state != "active":
            raise SandboxNotFoundError(f"session {session_id[:11]} has no active sandbox")
        return rebind(await self.provider.connect(record.sandbox_id), session_id)

    @contextlib.asynccontextmanager
    async def _connected(self, session_id: str) -> AsyncIterator[SandboxHandle]:
        """``connect``, closed after the block."""
        handle = await self.connect(session_id)
        try:
            yield handle
        finally:
            await handle.close()

    async def set_egress(self, session_id: str, policy: EgressPolicy) -> EgressStatus:
        """Replace the egress policy of the session's running sandbox, at once.

        The policy lives with that sandbox: one launched later (after a suspend or a
        recycle) starts from its spec's ``egress`` again, so callers that want a
        policy to last pass it with every turn (``ExecCall.egress``).
        ``SandboxNotFoundError`` if the session has no active sandbox.
        """
        async with self._connected(session_id) as handle:
            return await self.sandboxes.egress.apply(handle, policy)

    async def egress_status(self, session_id: str) -> EgressStatus:
        """The egress policy, counters and latest refusals of the session's running sandbox.

        Each refusal names its destination (name, address, port) and reason; the
        window is the runner's (its latest 100). ``SandboxNotFoundError`` if the
        session has no active sandbox.
        """
        async with self._connected(session_id) as handle:
            return await self.sandboxes.egress.status(handle)

    async def apply_egress(self, handle: SandboxHandle, policy: EgressPolicy) -> EgressStatus:
        """Set ``policy`` on the caller's live sandbox ``handle`` (a turn that carries one)."""
        return await self.sandboxes.egress.apply(handle, policy)

    async def count_egress(self, handle: SandboxHandle) -> None:
        """Bring the egress metrics up to date with ``handle``'s sandbox (after a turn)."""
        await self.sandboxes.egress.count(handle)

    async def save(
        self,
        session_id: str,
        handle: SandboxHandle,
        *,
        workspace: PersistentWorkspace | None = None,
    ) -> SnapshotInfo:
        """Checkpoint the caller's live sandbox of ``session_id`` (it keeps running)."""
        async with self.hold(session_id) as hold:
            _require_active(hold, handle)
            return await self.checkpoint(hold, Attached(handle), workspace=workspace)

    async def copy_workspace(
        self, session_id: str, handle: SandboxHandle, key: str
    ) -> SnapshotInfo:
        """Stream the caller's live sandbox of ``session_id``'s workspace into ``key`` (it
        keeps running; the session's record and checkpoints are untouched), held so no
        suspend or turn of the session runs meanwhile."""
        async with self.hold(session_id) as hold:
            _require_active(hold, handle)
            return await self.persistence.save_to(handle, session_id=session_id, key=key)

    async def restore_workspace(
        self, session_id: str, handle: SandboxHandle, key: str, *, taken_of: str
    ) -> None:
        """Restore the object under ``key`` (``copy_workspace``'s of session ``taken_of``)
        into the caller's new sandbox of ``session_id``, before anything runs in it."""
        await self.persistence.restore(
            handle,
            session_id=session_id,
            key=key,
            timeout_s=self.budgets.checkpoint_s,
            taken_of=taken_of,
        )

    async def resume(self, session_id: str, spec: SandboxSpec, *, adopt: bool = False) -> Attached:
        """The session's sandbox, brought back if suspended (the caller owns the handle).

        ``launched``: a new sandbox of ``spec`` (restored from the session's checkpoint
        when it has one). Otherwise the live one was
        reused or the provider resumed it in place: it has what it had, its egress
        policy too, not necessarily ``spec``'s.

        A session the registry has no record of is ``SandboxNotFoundError``; with
        ``adopt`` (the caller knows the session existed: a wiped registry forgot it) it
        is restored from its newest checkpoint in the store instead, and is a
        ``CheckpointError`` when the store holds none (never an empty workspace)."""
        async with self.hold(session_id) as hold:
            attached = await self.attacher.resume(hold, spec, adopt=adopt)
        self.sandboxes.release(session_id)
        return attached

    async def replace_lost(self, session_id: str, spec: SandboxSpec) -> SandboxHandle:
        """Rebuild a sandbox that stopped answering from its last checkpoint.

        Whatever is left of the old one is destroyed and the row marked suspended
        first, so a failure at any step leaves a row the next attempt can resume.
        ``CheckpointError`` when nothing was ever checkpointed to rebuild from.
        """
        async with self.hold(session_id) as hold:
            attached = await self.attacher.replace_lost(hold, spec)
        self.sandboxes.release(session_id)
        return attached.handle

    async def suspend(
        self, session_id: str, *, workspace: PersistentWorkspace | None = None
    ) -> bool:
        """Suspend the session's active sandbox; False if it has none (nothing to do).

        Natively in place where the provider can; otherwise checkpoint → destroy →
        mark suspended (a failed checkpoint keeps the sandbox: nothing is lost).
        """
        async with self.hold(session_id) as hold:
            return await self.teardown.suspend(hold, workspace=workspace)

    async def destroy(self, session_id: str) -> bool:
        """Destroy the session's sandbox, its checkpoints and its row; whether it had a row."""
        async with self.hold(session_id) as hold:
            return await self.teardown.destroy(hold)

    async def record(self, session_id: str) -> SessionRecord | None:
        """The session's registry row."""
        return await self.registry.get(session_id)

    async def list(self) -> list[SessionRecord]:
        """Every session's registry row."""
        return await self.registry.list_records()

    async def current_checkpoint(self, session_id: str) -> str | None:
        """The key a restore of the session would read: the row's pointer, else the store's."""
        record = await self.registry.get(session_id)
        if record is not None:
            return record.checkpoint_key
        latest = Persistence.latest(await self.persistence.stored(session_id))
        return latest.key if latest else None

    async def sweep(self, *, idle_s: float) -> int:
        """Suspend sessions idle past ``idle_s``, tidy lost rows, collect old objects."""
        return await self.sweeper.sweep(idle_s=idle_s)

    async def aclose(self, *, destroy_sandboxes: bool) -> None:
        """Close clients; with ``destroy_sandboxes`` also destroy the sandboxes this
        process launched (active or natively suspended) and mark their rows suspended.

        With an embedded registry the sandboxes die with this process, so they go
        now, cleanly; their checkpoints stay in the snapshot store. Only this
        process's own: a registry file shared by other processes lists theirs too.
        """
        await self.sandboxes.aclose()
        if not destroy_sandboxes or not self.sandboxes.launched:
            return
        await self.teardown.leave(await self.registry.list_records())


def _require_active(hold: Hold, handle: SandboxHandle) -> None:
    """``SandboxNotFoundError`` unless ``handle`` is the held session's active sandbox."""
    record = hold.record
    if record is None or record.state != "active" or record.sandbox_id != handle.sandbox_id:
        raise SandboxNotFoundError(f"session {hold.session_id[:11]}: not this active sandbox")
