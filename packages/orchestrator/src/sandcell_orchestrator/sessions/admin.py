"""Session administration on top of ``ExecutionService``: list, destroy, suspend, sweep.

A mixin so the execution path (``execution.py``) stays one module's worth of reading;
it uses the service's registry, provider, store and handle cache.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import msgspec

from sandcell_protocol import checkpoint_key

from ..errors import SandboxError, SandboxNotFoundError, SessionBusyError
from ..handle import SandboxHandle
from ..metrics import Metrics
from ..providers.base import PersistentWorkspace, SandboxProvider
from ..registry import SessionRecord, SessionRegistry
from ..registry.lease import hold_session
from ..snapshots import SnapshotStore

log = logging.getLogger(__name__)


class SessionAdmin:
    """What an operator or an idle sweeper does to runtime sessions."""

    provider: SandboxProvider
    registry: SessionRegistry
    store: SnapshotStore
    metrics: Metrics
    lock_ttl_ms: int
    _handles: dict[str, SandboxHandle]
    _now: Callable[[], float]

    lost_checks_per_sweep = 64
    """How many active rows one sweep asks the provider about (round robin). Each
    ask is a provider call (a GetMicrovm, a container inspect): thousands of
    sessions must not make every sweep thousands of calls. A turn in a session
    whose sandbox is lost relaunches it anyway; this only tidies rows nobody uses."""
    _lost_cursor = ""

    async def list_sessions(self) -> list[SessionRecord]:
        return await self.registry.list_records()

    async def destroy_session(self, session_id: str) -> bool:
        """Destroy the session's sandbox, delete its checkpoint and record."""
        async with hold_session(self.registry, session_id, ttl_ms=self.lock_ttl_ms) as lease:
            record = await self.registry.get(session_id)
            handle = self._handles.pop(session_id, None)
            if handle is not None:
                await handle.close()
            if record is not None and record.state == "active":
                await self.provider.destroy(record.sandbox_id)
            await self.store.delete(checkpoint_key(session_id))
            if record is None:
                return False
            await self.registry.delete(lease, session_id, generation=record.generation)
            return True

    async def suspend_session(self, session_id: str) -> bool:
        """Suspend an idle session: its checkpoint is current, so the sandbox can go."""
        async with hold_session(self.registry, session_id, ttl_ms=self.lock_ttl_ms) as lease:
            record = await self.registry.get(session_id)
            if record is None or record.state != "active":
                return False
            handle = self._handles.pop(session_id, None)
            if handle is not None:
                await handle.close()
            if self.provider.capabilities.pause_resume:
                try:
                    connected = await self.provider.connect(record.sandbox_id)
                except SandboxNotFoundError:
                    connected = None
                if connected is not None:
                    await self.provider.persist(connected, PersistentWorkspace(), key="")
                    await connected.close()
                    # A natively suspended sandbox resumes on traffic: keep it active.
                    return True
            await self.provider.destroy(record.sandbox_id)
            await self.registry.put(
                lease, msgspec.structs.replace(record, state="suspended", updated_at_s=self._now())
            )
            return True

    async def sweep_idle(self, *, idle_s: float) -> int:
        """Suspend sessions idle past ``idle_s``; clean rows whose sandbox is gone."""
        count = 0
        for session_id in await self.registry.idle_sessions(older_than_s=idle_s, now_s=self._now()):
            try:
                if await self.suspend_session(session_id):
                    count += 1
                    self.metrics.inc("sandcell_idle_suspends_total")
            except (SessionBusyError, SandboxError) as exc:
                log.info("idle sweep skipped %s: %s", session_id[:11], type(exc).__name__)
        await self._forget_lost_sandboxes()
        return count

    async def _forget_lost_sandboxes(self) -> None:
        """Mark rows whose sandbox is gone as suspended (its remains destroyed): the next
        turn restores."""
        for record in self._next_lost_checks(await self.registry.list_records()):
            try:
                handle = await self.provider.connect(record.sandbox_id)
            except SandboxNotFoundError:
                handle = None
            except SandboxError:
                continue  # unreachable for now is not gone
            if handle is not None:
                await handle.close()
                continue
            try:
                async with hold_session(
                    self.registry, record.session_id, ttl_ms=self.lock_ttl_ms
                ) as lease:
                    current = await self.registry.get(record.session_id)
                    if current is not None and current.sandbox_id == record.sandbox_id:
                        stale = self._handles.pop(record.session_id, None)
                        if stale is not None:
                            await stale.close()
                        # A sandbox that died on its own leaves remains (a local
                        # runner's root and mounts, a stopped container): remove them.
                        await self.provider.destroy(record.sandbox_id)
                        await self.registry.put(
                            lease,
                            msgspec.structs.replace(
                                current, state="suspended", updated_at_s=self._now()
                            ),
                        )
                        self.metrics.inc("sandcell_fallbacks_total", reason="sandbox_gone")
            except (SessionBusyError, SandboxError) as exc:
                # The row stays active and is looked at again in a later round; the
                # rest of this round goes on.
                log.info("lost-sandbox check skipped %s: %s", record.session_id[:11], exc)

    def _next_lost_checks(self, records: list[SessionRecord]) -> list[SessionRecord]:
        """This sweep's share of the active rows: the next ones after the last checked."""
        active = sorted(
            (r for r in records if r.state == "active" and r.provider == self.provider.name),
            key=lambda record: record.session_id,
        )
        start = bisect.bisect_right([r.session_id for r in active], self._lost_cursor)
        batch = (active[start:] + active[:start])[: self.lost_checks_per_sweep]
        if batch:
            self._lost_cursor = batch[-1].session_id
        return batch
