"""``Sweeper``: what ``SandboxManager.sweep`` does each round, in bounded shares.

    idle suspends   sessions idle past the idle timeout are suspended (the manager's
                    one suspend policy)
    lost rows       active rows whose sandbox died on its own: remains destroyed,
                    row marked suspended (the next turn restores)
    collection      superseded checkpoint objects deleted (a stale holder's upload,
                    the objects a newer checkpoint replaced)
    answers         keyed stateless runs' saved answers (``answers/<key>``) past the
                    grace period deleted: by age alone, nothing points at them; one
                    page of their prefix a round, resumed where the last round stopped
    remains         sandboxes whose runner is gone (or, on Docker, a session's
                    container) that no record points at (a worker killed between
                    launch and record write, a wiped Redis): removed, where the
                    provider can list them (``Remains``)

Lost-row checks and collections each visit a bounded share of the rows per round,
round robin: each visit is a provider call or a store listing, and thousands of
sessions must not make every round thousands of calls.

Collection needs no lock. It lists the session's objects, then reads the
generation counter, then the record's pointer, in that order: an object whose
writer's generation is below the counter can never become the pointer any more
(its writer's record write is fenced), and if it was the pointer when read, it
is kept. A grace period covers the rest (another process's embedded writer).
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

from ..errors import SandboxError, SandboxNotFoundError, SandcellError, SessionBusyError
from ..providers.base import Remains
from ..registry import SessionRecord

if TYPE_CHECKING:
    from .manager import SandboxManager

__all__ = ["Sweeper"]

log = logging.getLogger(__name__)


class Sweeper:
    """One manager's idle suspends, lost-row checks and checkpoint collection."""

    lost_checks_per_sweep = 64
    """How many active rows one sweep asks the provider about (a GetMicrovm, a
    container inspect each). A turn in a session whose sandbox is lost relaunches
    it anyway; this only tidies rows nobody uses."""
    collections_per_sweep = 64
    """How many sessions' objects one sweep lists and collects."""
    answers_per_sweep = 1000
    """How many saved stateless answers one sweep looks at, deleting those past the grace
    period: one page of their prefix (one S3 list request), after the last sweep's page,
    so a round's cost does not grow with the keyed stateless runs of a grace period."""

    def __init__(self, manager: SandboxManager) -> None:
        self._manager = manager
        self._lost_cursor = ""
        self._collect_cursor = ""

    async def sweep(self, *, idle_s: float) -> int:
        """One round; returns how many idle sessions were suspended."""
        manager = self._manager
        count = 0
        records = await manager.registry.list_records()
        # Only active rows have anything to suspend: the sweeper takes no lock of a
        # session it would leave as it is (a caller's next turn would find it busy).
        active = {
            r.session_id
            for r in records
            if r.state == "active" and r.provider == manager.provider.name
        }
        idle = await manager.registry.idle_sessions(older_than_s=idle_s, now_s=manager._now())
        for session_id in (session_id for session_id in idle if session_id in active):
            try:
                if await manager.suspend(session_id):
                    count += 1
                    manager.metrics.inc("sandcell_idle_suspends_total")
            except SandcellError as exc:
                log.info("idle sweep skipped %s: %s", session_id[:11], type(exc).__name__)
        if count:
            records = await manager.registry.list_records()  # the rows just suspended
        await self._forget_lost(records)
        await self._collect(records)
        await self._collect_answers()
        await self._remove_remains(records)
        return count

    async def _collect_answers(self) -> None:
        answers = self._manager.stateless_answers
        try:
            await answers.collect_older(limit=self.answers_per_sweep)
        except SandcellError as exc:
            log.info("stateless answers not collected: %s", type(exc).__name__)

    async def _remove_remains(self, records: list[SessionRecord]) -> None:
        manager = self._manager
        provider = manager.provider
        if not isinstance(provider, Remains):
            return
        try:
            dead = await provider.dead_sandboxes()
        except SandcellError as exc:
            log.info("remains not listed: %s", type(exc).__name__)
            return
        # Rows that point at a dead sandbox are the lost-row check's; a sandbox younger
        # than a launch may still be starting (its runner not up yet).
        starting_s = manager.budgets.launch_s + manager.budgets.health_s
        candidates = {s: age_s for s, age_s in dead.items() if age_s > starting_s}
        if candidates:
            # The rows as they are now, not at the round's start: a sandbox launched
            # since may have been recorded meanwhile (the idle suspends take a while).
            records = await manager.registry.list_records()
        referenced = {r.sandbox_id for r in records if r.provider == provider.name}
        for sandbox_id in candidates:
            if sandbox_id in referenced:
                continue
            try:
                await provider.destroy(sandbox_id)
            except SandboxError as exc:
                log.info("remains of %s not removed: %s", sandbox_id, type(exc).__name__)
                continue
            manager.metrics.inc("sandcell_remains_removed_total")

    async def _forget_lost(self, records: list[SessionRecord]) -> None:
        manager = self._manager
        active = [r for r in records if r.state == "active" and r.provider == manager.provider.name]
        batch, self._lost_cursor = _share(active, self._lost_cursor, self.lost_checks_per_sweep)
        for record in batch:
            try:
                handle = await manager.provider.connect(record.sandbox_id)
            except SandboxNotFoundError:
                handle = None
            except SandboxError:
                continue  # unreachable for now is not gone
            if handle is not None:
                await handle.close()
                continue
            try:
                await self._mark_lost(record)
            except (SessionBusyError, SandboxError) as exc:
                # The row stays active and is looked at again in a later round; the
                # rest of this round goes on.
                log.info("lost-sandbox check skipped %s: %s", record.session_id[:11], exc)

    async def _mark_lost(self, record: SessionRecord) -> None:
        manager = self._manager
        async with manager.hold(record.session_id) as hold:
            current = hold.record
            if current is None or current.sandbox_id != record.sandbox_id:
                return
            await manager.sandboxes.forget(record.session_id)
            # A sandbox that died on its own leaves remains (a local runner's root
            # and mounts, a stopped container): remove them.
            await manager.provider.destroy(record.sandbox_id)
            await manager.records.write(hold, state="suspended")
            manager.metrics.inc("sandcell_fallbacks_total", reason="sandbox_gone")

    async def _collect(self, records: list[SessionRecord]) -> None:
        manager = self._manager
        batch, self._collect_cursor = _share(
            records, self._collect_cursor, self.collections_per_sweep
        )
        for record in batch:
            session_id = record.session_id
            try:
                stored = await manager.persistence.stored(session_id)
                if len(stored) < 2:
                    continue
                current = await manager.registry.current_generation(session_id)
                pointer = await manager.registry.get(session_id)
                if pointer is None:
                    # The record went (a wiped Redis) after it was listed: a holder
                    # that finds none restores the newest object below the counter it
                    # just moved, so nothing here may go; that holder collects.
                    continue
                keep = pointer.checkpoint_key
                deleted = await manager.persistence.collect(
                    session_id, stored, keep=keep, below_generation=current
                )
            except SandcellError as exc:
                log.info("collection skipped %s: %s", session_id[:11], type(exc).__name__)
                continue
            if deleted:
                manager.metrics.inc("sandcell_checkpoints_collected_total", deleted)


def _share(records: list[SessionRecord], cursor: str, size: int) -> tuple[list[SessionRecord], str]:
    """The next ``size`` rows after ``cursor`` (by session id, wrapping), and the new cursor."""
    ordered = sorted(records, key=lambda record: record.session_id)
    start = bisect.bisect_right([r.session_id for r in ordered], cursor)
    batch = (ordered[start:] + ordered[:start])[:size]
    return batch, (batch[-1].session_id if batch else cursor)
