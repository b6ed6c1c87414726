"""``Teardown``: how a held session's sandbox goes away, and this process's at exit.

    suspend   one policy, branching only on the provider's capability: suspend in
              place (``NativeSuspend``), or checkpoint → destroy → mark suspended,
              so a failure at any step leaves the session resumable
    destroy   the sandbox, every checkpoint object of the session, then its row
    leave     at exit, the sandboxes this process launched, their rows marked
              suspended (the next process restores without probing them)

``SandboxManager`` takes the hold (``suspend``, ``destroy``) and calls these.
"""

from __future__ import annotations

import contextlib
import logging

from ..errors import SandboxError, SandboxNotFoundError, SandcellError
from ..providers.base import SandboxProvider
from ..registry import SessionRecord
from .commits import TurnCommits
from .holds import Holds
from .persistence import Persistence, PersistentWorkspace
from .records import SessionRecords
from .sandboxes import Attached, Hold, Sandboxes, rebind

__all__ = ["Teardown"]

log = logging.getLogger(__name__)


class Teardown:
    """Suspends and destroys held sessions' sandboxes of ``provider``; see the module."""

    def __init__(
        self,
        provider: SandboxProvider,
        sandboxes: Sandboxes,
        records: SessionRecords,
        persistence: Persistence,
        commits: TurnCommits,
        holds: Holds,
    ) -> None:
        self.provider = provider
        self.sandboxes = sandboxes
        self.records = records
        self.persistence = persistence
        self.commits = commits
        self.holds = holds

    async def suspend(self, hold: Hold, *, workspace: PersistentWorkspace | None) -> bool:
        """Suspend the held session's active sandbox; False if it has none (nothing to do).

        Natively in place where the provider can; otherwise checkpoint → destroy →
        mark suspended (a failed checkpoint keeps the sandbox: nothing is lost).
        """
        record = hold.record
        if record is None or record.state != "active" or record.provider != self.provider.name:
            return False
        session_id = hold.session_id
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
                    await self.commits.checkpoint(hold, Attached(handle), workspace=workspace)
            finally:
                await handle.close()
        if handle is None or self.sandboxes.native is None:
            await self.provider.destroy(record.sandbox_id)
        await self.records.write(hold, state="suspended")
        return True

    async def destroy(self, hold: Hold) -> bool:
        """Destroy the held session's sandbox, its checkpoints and its row; whether it had
        a row."""
        record = hold.record
        session_id = hold.session_id
        cached = self.sandboxes.take(session_id)
        if cached is not None and (record is None or cached.sandbox_id != record.sandbox_id):
            # No record points at this process's sandbox of the session (a wiped
            # registry lost it): nothing else would ever remove it.
            await self.sandboxes.discard(cached)
        elif cached is not None:
            await cached.close()
        if record is not None and record.provider == self.provider.name:
            await self.provider.destroy(record.sandbox_id)
        await self.persistence.delete_all(
            session_id, also=record.checkpoint_key if record else None
        )
        if record is None:
            return False
        await self.records.delete(hold)
        return True

    async def leave(self, records: list[SessionRecord]) -> None:
        """Destroy the sandboxes this process launched (active or natively suspended)
        among ``records`` and mark their rows suspended."""
        native = self.sandboxes.native is not None
        for record in records:
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
            async with self.holds.hold(session_id) as hold:
                if hold.record is not None and hold.record.sandbox_id == sandbox_id:
                    await self.records.write(hold, state="suspended")
        except SandcellError as exc:  # busy or lost: the next holder finds it gone instead
            log.info("session %s: left its row as it was (%s)", session_id[:11], exc)
