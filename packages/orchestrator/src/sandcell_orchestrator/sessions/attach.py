"""``Attacher``: which sandbox serves a held session, restored before anything runs.

The live one (reused), one the provider suspended natively (resumed), or a new one
restored from the current checkpoint, fail closed: a failed restore raises
(retryable) and the new sandbox is gone. A live sandbox whose last turn never
closed is replaced, never reused: its job may have written without committing;
one that stopped answering is rebuilt the same way (``replace_lost``).
"""

from __future__ import annotations

import logging

from ..config import Budgets
from ..errors import (
    ArchiveRejectedError,
    CheckpointError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from ..handle import SandboxHandle
from ..metrics import Metrics
from ..providers.base import SandboxProvider, SandboxSpec
from ..snapshots import SnapshotNotFoundError
from .persistence import Persistence
from .records import SessionRecords
from .sandboxes import Attached, Hold, Sandboxes, labelled, rebind

__all__ = ["Attacher"]

log = logging.getLogger(__name__)


class Attacher:
    """Attaches sandboxes of ``provider`` to holds; retires the ones it must not reuse."""

    def __init__(
        self,
        provider: SandboxProvider,
        sandboxes: Sandboxes,
        records: SessionRecords,
        persistence: Persistence,
        *,
        budgets: Budgets,
        metrics: Metrics,
    ) -> None:
        self.provider = provider
        self.sandboxes = sandboxes
        self.records = records
        self.persistence = persistence
        self.budgets = budgets
        self.metrics = metrics

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
                        await self.records.write(
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
        return await self.launch_restored(hold, spec)

    async def acquire(self, hold: Hold, spec: SandboxSpec, *, owner: str) -> SandboxHandle:
        """A new sandbox for the held new session, labelled ``owner``'s and recorded;
        if recording fails it is destroyed, not orphaned."""
        session_id = hold.session_id
        handle = rebind(await self.sandboxes.launch(labelled(spec, session_id, owner)), session_id)
        try:
            await self.records.write(
                hold, state="active", sandbox_id=handle.sandbox_id, endpoint=handle.endpoint
            )
        except BaseException:
            await self.sandboxes.discard(handle)
            raise
        return handle

    async def resume(self, hold: Hold, spec: SandboxSpec, *, adopt: bool) -> Attached:
        """``attach`` for a session that exists: one the registry has no record of is
        ``SandboxNotFoundError``, unless ``adopt`` (restored from the store's newest
        checkpoint; ``CheckpointError`` when there is none, never an empty workspace)."""
        if hold.record is None and not adopt:
            raise SandboxNotFoundError(f"session {hold.session_id[:11]} is not registered")
        if hold.record is None and hold.checkpoint_key is None:
            raise CheckpointError(f"session {hold.session_id[:11]}: no record and no checkpoint")
        return await self.attach(hold, spec)

    async def replace_lost(self, hold: Hold, spec: SandboxSpec) -> Attached:
        """Rebuild the held session's sandbox that stopped answering from its checkpoint.

        Whatever is left of the old one is destroyed and the row marked suspended
        first, so a failure at any step leaves a row the next attempt can resume.
        """
        record = hold.record
        if record is None:
            raise SandboxNotFoundError(f"session {hold.session_id[:11]} is not registered")
        if hold.checkpoint_key is None:
            raise CheckpointError(
                f"session {hold.session_id[:11]} has no checkpoint to rebuild from"
            )
        await self.sandboxes.forget(hold.session_id)
        # Destroy even a row already marked suspended (a sweeper marks lost
        # sandboxes so): its remains still need removing.
        await self.provider.destroy(record.sandbox_id)
        await self.records.mark_suspended(hold)
        return await self.launch_restored(hold, spec)

    async def launch_restored(self, hold: Hold, spec: SandboxSpec) -> Attached:
        """A new sandbox for the hold, recorded, with the current checkpoint restored."""
        # A client of ours that no record points at any more (lost or corrupt)
        # must not orphan its sandbox.
        stale = self.sandboxes.take(hold.session_id)
        if stale is not None:
            await self.sandboxes.discard(stale)
        handle = rebind(
            await self.sandboxes.launch(labelled(spec, hold.session_id)), hold.session_id
        )
        restoring = hold.checkpoint_key is not None
        try:
            await self.records.write(
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
            await self.sandboxes.discard(handle)
            raise
        self.sandboxes.keep(hold.session_id, handle)
        if hold.checkpoint_key is None:
            return Attached(handle, launched=True)
        await self._restore(hold, handle, hold.checkpoint_key)
        try:
            await self.records.write(hold, turn_open=False)
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
        await self.sandboxes.shielded(self.retire(hold, handle))

    async def retire(self, hold: Hold, handle: SandboxHandle) -> None:
        """Destroy the held session's sandbox and mark its row suspended."""
        await self.sandboxes.destroy_quietly(handle)
        await self.records.mark_suspended(hold)
