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

Suspend has one policy, branching only on the provider's capability: suspend in
place (``NativeSuspend``), or checkpoint → destroy → mark suspended, so a failure
at any step leaves the session resumable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from sandcell_protocol import EgressPolicy, EgressStatus, checkpoint_key

from ..config import Budgets
from ..errors import (
    ArchiveRejectedError,
    CheckpointError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
    SandcellError,
    SessionBusyError,
)
from ..handle import SandboxHandle
from ..metrics import Metrics
from ..providers.base import SandboxProvider, SandboxSpec
from ..registry import IdempotentAnswer, Lease, SessionRecord, SessionRegistry
from ..registry.lease import hold_session
from ..snapshots import SnapshotInfo, SnapshotNotFoundError, SnapshotStore
from .persistence import Persistence, PersistentWorkspace, StoredCheckpoint, TurnResult
from .sandboxes import Attached, Hold, Sandboxes, labelled, rebind, sandbox_session_key
from .sweep import Sweeper

__all__ = ["Attached", "Hold", "SandboxManager", "rebind", "sandbox_session_key"]

log = logging.getLogger(__name__)

_NO_RECORD_GAP = 1 << 20
"""How far a hold that finds neither a record nor a generation counter (the registry
forgot the session) moves the generation past the newest object."""


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
        self.registry = registry
        self.budgets = budgets or Budgets()
        self.metrics = metrics or Metrics()
        self.persistence = Persistence(
            store, max_bytes=checkpoint_max_bytes, grace_s=checkpoint_grace_s, wall_clock=wall_clock
        )
        # Not the turn's length: the holder renews the lock while the turn runs.
        self.lock_ttl_ms = math.ceil(self.budgets.lock_ttl_s * 1000)
        self.sandboxes = Sandboxes(provider, budgets=self.budgets, metrics=self.metrics)
        self.sweeper = Sweeper(self)
        self._now = wall_clock

    def __repr__(self) -> str:
        return f"SandboxManager(provider={self.provider.name!r})"

    @property
    def store(self) -> SnapshotStore:
        return self.persistence.store

    # -- holding ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str, *, wait_ms: int = 0) -> AsyncIterator[Hold]:
        """Hold the session (its lock, renewed; ``LockLostError`` out if lost) and a
        generation of its own; ``SessionBusyError`` if another holder has it."""
        entered = False
        try:
            async with hold_session(
                self.registry, session_id, ttl_ms=self.lock_ttl_ms, wait_ms=wait_ms
            ) as lease:
                entered = True
                yield await self._begin(session_id, lease)
        except SessionBusyError:
            if not entered:
                self.metrics.inc("sandcell_lock_contention_total")
            raise

    async def _begin(self, session_id: str, lease: Lease) -> Hold:
        record = await self.registry.get(session_id)
        if record is not None:
            generation = await self.registry.next_generation(session_id)
            return Hold(session_id, lease, generation, record, record.checkpoint_key)
        # No record (a new session, an embedded registry of a new process, a wiped
        # Redis): the store says what the newest checkpoint is, and the generation
        # moves past the newest one's so this hold never writes an older holder's key.
        try:
            stored = await self.persistence.stored(session_id)
        except CheckpointError as exc:
            self.metrics.inc("sandcell_restores_total", outcome="failed")
            raise SandboxUnavailableError(
                f"cannot list the session's checkpoints ({type(exc).__name__}); retry"
            ) from exc
        latest = Persistence.latest(stored)
        floor = latest.generation if latest else 0
        if await self.registry.current_generation(session_id) == 0:
            # The registry forgot the session (a wiped Redis, a new in-process
            # registry): a holder from before may still be mid-turn a few generations
            # past the newest object, and must never share a generation, and so a
            # checkpoint key, with this hold. A kept counter (a new or deleted
            # session, a lost record) already fences: the next one is never reused.
            floor += _NO_RECORD_GAP
        generation = await self.registry.next_generation(session_id, above=floor)
        key = latest.key if latest else None
        return Hold(session_id, lease, generation, None, key, stored=stored)

    # -- attaching ----------------------------------------------------------------

    async def attach(self, hold: Hold, spec: SandboxSpec, *, verify: bool = True) -> Attached:
        """The session's sandbox: the live one, a natively resumed one, or a new one
        restored from the current checkpoint before anything runs (fail closed: a
        failed restore raises, retryable, and the new sandbox is gone).

        ``verify=False``: a live sandbox is used without a ``/health`` check first.
        """
        record = hold.record
        if record is not None and record.provider == self.provider.name:
            if record.state == "active" and record.turn_open:
                # The last holder never closed its turn (killed, paused past its lock):
                # its job may have written to the live sandbox without committing.
                log.warning(
                    "session %s: the last turn did not close; replacing its sandbox",
                    hold.session_id[:11],
                )
                self.metrics.inc("sandcell_fallbacks_total", reason="recycled")
                await self.sandboxes.forget(hold.session_id)
                await self.sandboxes.shielded(self.provider.destroy(record.sandbox_id))
            elif record.state == "active":
                handle = await self.sandboxes.reuse(hold.session_id, record, verify=verify)
                if handle is not None:
                    return Attached(handle)
            else:
                handle = await self.sandboxes.resume_native(hold.session_id, record, spec)
                if handle is not None:
                    try:
                        await self._write(
                            hold,
                            state="active",
                            sandbox_id=handle.sandbox_id,
                            endpoint=handle.endpoint,
                        )
                    except BaseException:
                        await handle.close()
                        raise
                    self.sandboxes.keep(hold.session_id, handle)
                    return Attached(handle)
        return await self._launch_restored(hold, spec)

    async def _launch_restored(self, hold: Hold, spec: SandboxSpec) -> Attached:
        # A client of ours that no record points at any more (lost or corrupt)
        # must not orphan its sandbox.
        stale = self.sandboxes.take(hold.session_id)
        if stale is not None:
            await self.discard(stale)
        handle = rebind(await self.launch(labelled(spec, hold.session_id)), hold.session_id)
        restoring = hold.checkpoint_key is not None
        try:
            await self._write(
                hold,
                state="active",
                sandbox_id=handle.sandbox_id,
                endpoint=handle.endpoint,
                checkpoint_key=hold.checkpoint_key,
                # A new sandbox holds nothing unsaved: whatever was is lost with the old one.
                unsaved=False,
                # Recorded before its restore (so it is never orphaned) but open until the
                # restore is done: a holder stopped mid-restore (SIGSTOP, a VM pause, past
                # its lock) cannot drop it, and the next holder must replace this sandbox,
                # whose workspace is still empty or partial, not reuse it.
                turn_open=restoring,
            )
        except BaseException:
            # Fenced (or the registry failed): never leave an orphan behind.
            await self.discard(handle)
            raise
        self.sandboxes.keep(hold.session_id, handle)
        if hold.checkpoint_key is None:
            return Attached(handle, launched=True)
        await self._restore(hold, handle, hold.checkpoint_key)
        try:
            await self._write(hold, turn_open=False)
        except BaseException:
            await self._drop(hold, handle)
            raise
        return Attached(handle, launched=True, restored=True)

    async def _restore(self, hold: Hold, handle: SandboxHandle, key: str) -> None:
        try:
            with self.metrics.timer("sandcell_restore_duration_seconds"):
                await self.persistence.restore(
                    handle,
                    session_id=hold.session_id,
                    key=key,
                    timeout_s=self.budgets.checkpoint_s,
                )
        except SnapshotNotFoundError:
            self.metrics.inc("sandcell_restores_total", outcome="missing")
            await self._drop(hold, handle)
            raise CheckpointError(
                f"session {hold.session_id[:11]}: its checkpoint is missing"
            ) from None
        except ArchiveRejectedError:
            self.metrics.inc("sandcell_restores_total", outcome="rejected")
            await self._drop(hold, handle)
            raise
        except (CheckpointError, SandboxError) as exc:
            self.metrics.inc("sandcell_restores_total", outcome="failed")
            await self._drop(hold, handle)
            raise SandboxUnavailableError(
                f"restore failed ({type(exc).__name__}); the turn did not run, retry"
            ) from exc
        except BaseException:
            # Cancelled, or the lock lost, mid-restore: the recorded sandbox holds a
            # partial (or empty) workspace, so it must go before anybody reuses it.
            self.metrics.inc("sandcell_restores_total", outcome="failed")
            await self._drop(hold, handle)
            raise
        self.metrics.inc("sandcell_restores_total", outcome="ok")

    async def _drop(self, hold: Hold, handle: SandboxHandle) -> None:
        """A new sandbox whose restore failed: destroyed, and the record says so."""
        self.sandboxes.release(hold.session_id)
        await self.sandboxes.shielded(self._retire(hold, handle))

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
        """Save the sandbox's workspace (it keeps running) and point the record at it.

        The object goes under this hold's own generation (a second checkpoint in
        one hold first takes a new one), then the fenced record write commits it:
        ``LockLostError``/``FencedError`` if this holder was superseded, in which
        case its object is never referenced. ``answer`` (the turn's idempotent
        answer) is stored by that same write; ``turn_result`` (a keyed turn's) is
        saved next to the object, before it, so the store itself says which turn
        the object applied (``Persistence.save_turn_result``).
        """
        if hold.checkpointed:
            hold.generation = await self.registry.next_generation(hold.session_id)
        hold.checkpointed = True
        try:
            with self.metrics.timer("sandcell_checkpoint_duration_seconds"):
                async with asyncio.timeout(self.budgets.checkpoint_s):
                    if turn_result is not None:
                        await self.persistence.save_turn_result(
                            checkpoint_key(hold.session_id, hold.generation),
                            turn_key=turn_result.turn_key,
                            body=turn_result.body,
                        )
                    info = await self.persistence.save(
                        attached.handle,
                        session_id=hold.session_id,
                        generation=hold.generation,
                        workspace=workspace,
                    )
                await self._write(
                    hold, answer=answer, checkpoint_key=info.key, unsaved=False, turn_open=False
                )
        except Exception:
            self.metrics.inc("sandcell_checkpoints_total", outcome="failed")
            raise
        hold.checkpoint_key = info.key
        self.metrics.inc("sandcell_checkpoints_total", outcome="ok")
        self.metrics.inc("sandcell_checkpoint_bytes_total", info.size)
        if hold.stored is not None:
            # Listed at hold time: what this commit superseded goes (after the grace).
            await self.persistence.collect(
                hold.session_id, hold.stored, keep=info.key, below_generation=hold.generation
            )
        return info

    async def open_turn(self, hold: Hold) -> None:
        """Record that a turn's job is about to run in the held sandbox (``turn_open``):
        until the turn closes, no later holder reuses that sandbox."""
        if hold.record is not None and not hold.record.turn_open:
            await self._write(hold, turn_open=True)

    async def close_turn(
        self, hold: Hold, *, unsaved: bool = False, answer: IdempotentAnswer | None = None
    ) -> None:
        """Record that the held turn ended with nothing uncommitted in its sandbox, or
        (``unsaved``) with acknowledged work no checkpoint has, which whichever worker
        takes the next turn saves (the record is the one place every worker reads).
        ``answer`` (the turn's idempotent answer) is stored by that same write."""
        record = hold.record
        if record is not None and (record.turn_open or record.unsaved != unsaved):
            await self._write(
                hold, answer=answer, turn_open=False, unsaved=unsaved or record.unsaved
            )

    def applied_turn(self, hold: Hold) -> StoredCheckpoint | None:
        """The checkpoint a hold that found no record restores, if a keyed turn wrote it
        with its result (``checkpoint(turn_result=...)``): that turn is applied in it,
        committed or not (its record write may be what the registry forgot)."""
        if hold.stored is None or hold.checkpoint_key is None:
            return None
        latest = Persistence.latest(hold.stored)
        if latest is None or latest.key != hold.checkpoint_key or latest.turn_key is None:
            return None
        return latest

    async def commit_answer(self, hold: Hold, answer: IdempotentAnswer) -> None:
        """Store a keyed turn's ``answer`` with a fenced write of the held record, as
        it stands (its pointer commits the checkpoint the turn was found applied in)."""
        await self._write(hold, answer=answer, turn_open=False)

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
        await self.sandboxes.shielded(self._retire(hold, attached.handle))

    async def _retire(self, hold: Hold, handle: SandboxHandle) -> None:
        await self.sandboxes.destroy_quietly(handle)
        await self._mark_suspended(hold)

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
            handle = rebind(await self.launch(labelled(spec, session_id, owner)), session_id)
            try:
                await self._write(
                    hold, state="active", sandbox_id=handle.sandbox_id, endpoint=handle.endpoint
                )
            except BaseException:
                await self.discard(handle)
                raise
        return handle

    async def connect(self, session_id: str) -> SandboxHandle:
        """A handle to an active sandbox; ``SandboxNotFoundError`` if suspended or gone."""
        record = await self.registry.get(session_id)
        if record is None or record.state != "active":
            raise SandboxNotFoundError(f"session {session_id[:11]} has no active sandbox")
        return rebind(await self.provider.connect(record.sandbox_id), session_id)

    async def set_egress(self, session_id: str, policy: EgressPolicy) -> EgressStatus:
        """Replace the egress policy of the session's running sandbox, at once.

        The policy lives with that sandbox: one launched later (after a suspend or a
        recycle) starts from its spec's ``egress`` again, so callers that want a
        policy to last pass it with every turn (``ExecCall.egress``).
        ``SandboxNotFoundError`` if the session has no active sandbox.
        """
        handle = await self.connect(session_id)
        try:
            return await self.sandboxes.egress.apply(handle, policy)
        finally:
            await handle.close()

    async def egress_status(self, session_id: str) -> EgressStatus:
        """The egress policy, counters and latest refusals of the session's running sandbox.

        Each refusal names its destination (name, address, port) and reason; the
        window is the runner's (its latest 100). ``SandboxNotFoundError`` if the
        session has no active sandbox.
        """
        handle = await self.connect(session_id)
        try:
            return await self.sandboxes.egress.status(handle)
        finally:
            await handle.close()

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
            record = hold.record
            if record is None or record.state != "active" or record.sandbox_id != handle.sandbox_id:
                raise SandboxNotFoundError(f"session {session_id[:11]}: not this active sandbox")
            return await self.checkpoint(hold, Attached(handle), workspace=workspace)

    async def resume(self, session_id: str, spec: SandboxSpec) -> SandboxHandle:
        """The session's sandbox, brought back if suspended (the caller owns the handle)."""
        async with self.hold(session_id) as hold:
            if hold.record is None:
                raise SandboxNotFoundError(f"session {session_id[:11]} is not registered")
            attached = await self.attach(hold, spec)
        self.sandboxes.release(session_id)
        return attached.handle

    async def replace_lost(self, session_id: str, spec: SandboxSpec) -> SandboxHandle:
        """Rebuild a sandbox that stopped answering from its last checkpoint.

        Whatever is left of the old one is destroyed and the row marked suspended
        first, so a failure at any step leaves a row the next attempt can resume.
        ``CheckpointError`` when nothing was ever checkpointed to rebuild from.
        """
        async with self.hold(session_id) as hold:
            record = hold.record
            if record is None:
                raise SandboxNotFoundError(f"session {session_id[:11]} is not registered")
            if hold.checkpoint_key is None:
                raise CheckpointError(
                    f"session {session_id[:11]} has no checkpoint to rebuild from"
                )
            await self.sandboxes.forget(session_id)
            # Destroy even a row already marked suspended (a sweeper marks lost
            # sandboxes so): its remains still need removing.
            await self.provider.destroy(record.sandbox_id)
            await self._mark_suspended(hold)
            attached = await self._launch_restored(hold, spec)
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
            record = hold.record
            if record is None or record.state != "active" or record.provider != self.provider.name:
                return False
            await self.sandboxes.forget(session_id)
            try:
                handle = rebind(await self.provider.connect(record.sandbox_id), session_id)
            except SandboxNotFoundError:
                handle = None  # died on its own: the last checkpoint is the restore point
            if handle is not None and record.turn_open:
                # A turn that never closed may have left uncommitted writes: the last
                # checkpoint is the restore point, not this sandbox's workspace.
                await handle.close()
                handle = None
            if handle is not None:
                try:
                    if self.sandboxes.native is not None:
                        await self.sandboxes.native.suspend(record.sandbox_id)
                    else:
                        await self.checkpoint(hold, Attached(handle), workspace=workspace)
                finally:
                    await handle.close()
            if handle is None or self.sandboxes.native is None:
                await self.provider.destroy(record.sandbox_id)
            await self._write(hold, state="suspended")
        return True

    async def destroy(self, session_id: str) -> bool:
        """Destroy the session's sandbox, its checkpoints and its row; whether it had a row."""
        async with self.hold(session_id) as hold:
            record = hold.record
            await self.sandboxes.forget(session_id)
            if record is not None and record.provider == self.provider.name:
                await self.provider.destroy(record.sandbox_id)
            await self.persistence.delete_all(
                session_id, also=record.checkpoint_key if record else None
            )
            if record is None:
                return False
            await self.registry.delete(hold.lease, session_id, generation=hold.generation)
            return True

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
        native = self.sandboxes.native is not None
        for record in await self.registry.list_records():
            if record.sandbox_id not in self.sandboxes.launched:
                continue
            if record.provider != self.provider.name or not (record.state == "active" or native):
                continue
            with contextlib.suppress(SandboxError):
                await self.provider.destroy(record.sandbox_id)
            self.sandboxes.launched.discard(record.sandbox_id)
            await self._mark_left(record.session_id, record.sandbox_id)

    async def _mark_left(self, session_id: str, sandbox_id: str) -> None:
        """Mark a row whose sandbox this process destroyed at exit as suspended, so the
        next process restores without first probing a sandbox that is gone."""
        try:
            async with self.hold(session_id) as hold:
                if hold.record is not None and hold.record.sandbox_id == sandbox_id:
                    await self._write(hold, state="suspended")
        except SandcellError as exc:  # busy or lost: the next holder finds it gone instead
            log.info("session %s: left its row as it was (%s)", session_id[:11], exc)

    # -- records --------------------------------------------------------------------------

    async def _write(
        self, hold: Hold, *, answer: IdempotentAnswer | None = None, **changes: Any
    ) -> SessionRecord:
        """The one ``SessionRecord`` builder: the held row with ``changes``, stamped with
        this hold's generation, written fenced by its lease (with ``answer``, if any)."""
        now = self._now()
        if hold.record is not None:
            fields = msgspec.structs.asdict(hold.record)
        else:
            fields = {
                "session_id": hold.session_id,
                "provider": self.provider.name,
                "sandbox_uuid": str(uuid.uuid4()),
                "endpoint": None,
                "checkpoint_key": None,
                "state": "active",
                "created_at_s": now,
            }
        record = SessionRecord(
            **{**fields, **changes, "generation": hold.generation, "updated_at_s": now}
        )
        await self.registry.put(hold.lease, record, answer=answer)
        hold.record = record
        return record

    async def _mark_suspended(self, hold: Hold) -> None:
        if hold.record is None:
            return
        try:
            await self._write(hold, state="suspended")
        except Exception as exc:  # the lease may be gone: the next holder sees a lost sandbox
            log.info("session %s: could not mark it suspended (%s)", hold.session_id[:11], exc)
