"""``Sandboxes``: the provider side of ``SandboxManager``.

Launch within the budgets, reach a session's live sandbox (one cached client
per session, checked with ``/health`` before it is trusted), resume one the
provider suspended natively, and discard a sandbox to the end even while the
caller is cancelled. Registry rows and checkpoints are the manager's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from ..config import Budgets
from ..errors import SandboxError, SandboxNotFoundError, SandboxUnavailableError
from ..handle import SandboxHandle
from ..metrics import Metrics
from ..providers.base import SESSION_LABEL, SandboxProvider, SandboxSpec, native_suspend
from ..registry import Lease, SessionRecord
from ..to_the_end import to_the_end
from .egress import EgressTracker
from .persistence import StoredCheckpoint

__all__ = ["Attached", "Hold", "Sandboxes", "labelled", "rebind", "sandbox_session_key"]

log = logging.getLogger(__name__)

OWNER_LABEL = "sandcell.owner"


def sandbox_session_key(sandbox_uuid: str) -> str:
    """The runtime-session id of an app-style sandbox known by a stable ``sandbox_uuid``."""
    return "rt_" + hashlib.sha256(b"sandbox-uuid\x00" + sandbox_uuid.encode()).hexdigest()


@dataclass(eq=False)
class Hold:
    """A held session: its lease, this hold's generation, and what the hold found.

    ``checkpoint_key`` is the current checkpoint: the record's pointer, or (when
    no record survived) the newest object the store holds for the session.
    """

    session_id: str
    lease: Lease
    generation: int
    record: SessionRecord | None
    checkpoint_key: str | None
    stored: list[StoredCheckpoint] | None = None
    """The session's objects, when the hold had to list them (no record)."""
    checkpointed: bool = False


@dataclass(frozen=True, slots=True)
class Attached:
    """The sandbox a hold works in, and how it got there."""

    handle: SandboxHandle
    launched: bool = False
    restored: bool = False


def rebind(handle: SandboxHandle, session_id: str) -> SandboxHandle:
    """The same sandbox and runner client, speaking as ``session_id``."""
    if handle.session_id == session_id:
        return handle
    return SandboxHandle(
        sandbox_id=handle.sandbox_id,
        provider=handle.provider,
        runner=handle.runner,
        session_id=session_id,
        endpoint=handle.endpoint,
    )


def labelled(spec: SandboxSpec, session_id: str, owner: str | None = None) -> SandboxSpec:
    """``spec`` labelled with the runtime session its runner binds to (and an owner)."""
    labels = {**spec.labels, SESSION_LABEL: session_id}
    if owner is not None:
        labels[OWNER_LABEL] = owner
    return dataclasses.replace(spec, labels=labels)


class Sandboxes:
    """Launch, reuse, resume natively and discard sandboxes of one provider."""

    def __init__(self, provider: SandboxProvider, *, budgets: Budgets, metrics: Metrics) -> None:
        self.provider = provider
        self.native = native_suspend(provider)
        self._budgets = budgets
        self._metrics = metrics
        self._handles: dict[str, SandboxHandle] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self.launched: set[str] = set()
        """Ids of the sandboxes this process launched and has not destroyed."""
        self.egress = EgressTracker(metrics)

    async def launch(self, spec: SandboxSpec) -> SandboxHandle:
        """A new sandbox, within the launch and health budgets."""
        try:
            with self._metrics.timer("sandcell_launch_duration_seconds"):
                async with asyncio.timeout(self._budgets.launch_s + self._budgets.health_s):
                    handle = await self.provider.create(spec)
        except TimeoutError:
            self._metrics.inc("sandcell_launches_total", outcome="timeout")
            raise SandboxUnavailableError("sandbox launch timed out") from None
        except SandboxError:
            self._metrics.inc("sandcell_launches_total", outcome="failed")
            raise
        self._metrics.inc("sandcell_launches_total", outcome="ok")
        self.launched.add(handle.sandbox_id)
        if spec.egress is not None:
            # Before anything runs in it: a sandbox never runs under another policy.
            try:
                await self.egress.apply(handle, spec.egress)
            except BaseException:
                await self.discard(handle)
                raise
        return handle

    async def discard(self, handle: SandboxHandle) -> None:
        """Close and destroy ``handle``'s sandbox, to the end even when cancelled."""
        await self.shielded(self.destroy_quietly(handle))

    async def destroy_quietly(self, handle: SandboxHandle) -> None:
        with contextlib.suppress(Exception):
            await handle.close()
        try:
            await self.provider.destroy(handle.sandbox_id)
        except SandboxError as exc:
            log.warning("destroy of %s failed: %s", handle.sandbox_id, exc)
        else:
            self.launched.discard(handle.sandbox_id)
            self.egress.forget(handle.sandbox_id)

    async def reuse(
        self, session_id: str, record: SessionRecord, *, verify: bool = True
    ) -> SandboxHandle | None:
        """The session's live sandbox, or None (an unreachable one is destroyed).

        ``verify=False`` trusts a reachable sandbox without its ``/health`` round trip
        (the caller's own first request then fails if it died).
        """
        handle = self._handles.get(session_id)
        if handle is not None and handle.sandbox_id != record.sandbox_id:
            # Another worker relaunched the session: our sandbox is no longer the
            # session's (dead, or alive behind a record that was lost): remove it.
            del self._handles[session_id]
            await self.destroy_quietly(handle)
            handle = None
        if handle is None:
            try:
                handle = rebind(await self.provider.connect(record.sandbox_id), session_id)
            except (SandboxNotFoundError, SandboxUnavailableError):
                handle = None
        if handle is not None and not verify:
            self._handles[session_id] = handle
            return handle
        if handle is not None:
            try:
                health = await handle.runner.health()
            except SandboxError:
                health = None
            if (
                health is not None
                and health.status == "ok"
                and health.session_id in (None, session_id)
            ):
                self._handles[session_id] = handle
                return handle
        log.warning(
            "session %s: sandbox %s unreachable; relaunching", session_id[:11], record.sandbox_id
        )
        self._metrics.inc("sandcell_fallbacks_total", reason="sandbox_lost")
        self._handles.pop(session_id, None)
        if handle is not None:
            await handle.close()
        await self.provider.destroy(record.sandbox_id)
        return None

    async def resume_native(
        self, session_id: str, record: SessionRecord, spec: SandboxSpec
    ) -> SandboxHandle | None:
        """The natively suspended sandbox, resumed; None (remains destroyed) if it is gone."""
        if self.native is None:
            return None
        try:
            resumed = await self.native.resume(record.sandbox_id, labelled(spec, session_id))
        except SandboxNotFoundError:
            await self.provider.destroy(record.sandbox_id)
            return None
        return rebind(resumed, session_id)

    def keep(self, session_id: str, handle: SandboxHandle) -> None:
        """Cache ``handle`` as the session's client for the next turns."""
        self._handles[session_id] = handle

    def take(self, session_id: str) -> SandboxHandle | None:
        """The session's cached client, no longer cached."""
        return self._handles.pop(session_id, None)

    def release(self, session_id: str) -> None:
        """Stop caching the session's client (its caller owns it now)."""
        self._handles.pop(session_id, None)

    async def forget(self, session_id: str) -> None:
        """Close and forget the session's cached client (the sandbox lives on)."""
        handle = self._handles.pop(session_id, None)
        if handle is not None:
            await handle.close()

    async def shielded(self, cleanup: Coroutine[Any, Any, None]) -> None:
        """Run cleanup to completion even while the caller is being cancelled.

        Neither a lost lease (an anyio scope) nor any number of plain
        ``task.cancel()`` can stop it half-way (``to_the_end``); ``aclose`` waits
        for those in flight.
        """
        await to_the_end(cleanup, keep=self._cleanups)

    async def aclose(self) -> None:
        """Wait for cleanups in flight; close every cached client."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            with contextlib.suppress(Exception):
                await handle.close()
