"""ExecutionService: the code-interpreter path, with runtime sessions.

``SANDCELL_RUNTIME_SESSION_MODE``:

- ``stateless``: one sandbox per call; deliver inputs, execute, destroy (also on
  cancel and error).
- ``affinity`` / ``strict`` with a hint: derive the runtime session id, take its
  lock, find or launch its one warm sandbox, restore the last checkpoint before
  the first execute on a fresh sandbox, push missing inputs, execute, checkpoint
  (fenced, best-effort), update the record, release.
- Without a hint ``affinity`` runs statelessly and ``strict`` refuses.

Fail closed on state, open on speed: a failed checkpoint keeps the previous one;
a failed restore never runs the turn on an empty workspace; a lost lock aborts
the work in flight; a sandbox that may be dirty is recycled, not reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from sandcell_protocol import ExecuteRequest, ExecuteResult, checkpoint_key, runtime_session_id

from ..config import Budgets, SessionMode
from ..errors import (
    ArchiveRejectedError,
    CheckpointError,
    LockLostError,
    SandboxError,
    SandboxNotFoundError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SessionBusyError,
    SessionConflictError,
    SessionRequiredError,
)
from ..handle import SandboxHandle
from ..metrics import Metrics
from ..providers.base import SESSION_LABEL, SandboxProvider, SandboxSpec
from ..registry import FencedError, Lease, SessionRecord, SessionRegistry
from ..registry.lease import hold_session
from ..registry.ttl import lock_ttl_ms
from ..runner.client import InputPayload
from ..snapshots import SnapshotNotFoundError, SnapshotStore
from .admin import SessionAdmin
from .inputs import InputSource
from .manager import rebind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who runs the code: a tenant namespace and a user within it."""

    namespace: str
    user_id: str


class ExecutionService(SessionAdmin):
    """Runs ``ExecuteRequest``s in sandboxes, statelessly or in runtime sessions."""

    def __init__(
        self,
        *,
        provider: SandboxProvider,
        registry: SessionRegistry,
        store: SnapshotStore,
        mode: SessionMode = "affinity",
        budgets: Budgets | None = None,
        checkpoint_max_bytes: int = 1 << 30,
        inputs: InputSource | None = None,
        metrics: Metrics | None = None,
        spec: SandboxSpec | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.provider = provider
        self.registry = registry
        self.store = store
        self.mode = mode
        self.budgets = budgets or Budgets()
        self.checkpoint_max_bytes = checkpoint_max_bytes
        self.inputs = inputs
        self.metrics = metrics or Metrics()
        self.spec = spec or SandboxSpec()
        self._now = wall_clock
        self.lock_ttl_ms = lock_ttl_ms(
            launch_s=self.budgets.launch_s,
            health_s=self.budgets.health_s,
            execute_s=self.budgets.execute_s,
            checkpoint_s=self.budgets.checkpoint_s,
        )
        self._handles: dict[str, SandboxHandle] = {}
        self._cleanups: set[asyncio.Task[None]] = set()

    # -- entry point ----------------------------------------------------------

    async def execute(
        self, request: ExecuteRequest, identity: Identity, *, hint: str | None = None
    ) -> ExecuteResult:
        """Run ``request`` for ``identity``; ``hint`` names a runtime session."""
        if self.mode == "stateless":
            return await self._stateless(request)
        if hint is None:
            if self.mode == "strict":
                raise SessionRequiredError("strict runtime-session mode needs a session hint")
            self.metrics.inc("sandcell_fallbacks_total", reason="no_hint")
            return await self._stateless(request)
        session_id = runtime_session_id(identity.namespace, identity.user_id, hint)
        return await self.execute_in_session(request, session_id)

    # -- stateless ------------------------------------------------------------

    async def _stateless(self, request: ExecuteRequest) -> ExecuteResult:
        handle = await self._launch(self.spec)
        try:
            await self._deliver_inputs(handle, request, session_id=None)
            result = await handle.runner.execute(request, timeout_s=self._turn_timeout(request))
        finally:
            await self._shielded(self._discard(handle))
        self.metrics.inc("sandcell_executions_total", status=str(result.status))
        return result

    # -- sessions -------------------------------------------------------------

    async def execute_in_session(self, request: ExecuteRequest, session_id: str) -> ExecuteResult:
        """The session path for an already-derived ``rt_…`` id."""
        try:
            async with hold_session(self.registry, session_id, ttl_ms=self.lock_ttl_ms) as lease:
                return await self._turn(request, session_id, lease)
        except SessionBusyError:
            self.metrics.inc("sandcell_lock_contention_total")
            raise

    async def _turn(self, request: ExecuteRequest, session_id: str, lease: Lease) -> ExecuteResult:
        record = await self.registry.get(session_id)
        handle = await self._reuse(session_id, record)
        launched = False
        if handle is None:
            handle, record = await self._launch_for_session(session_id, record, lease)
            launched = True
        assert record is not None
        restored = False
        try:
            if launched and await self._restore(handle, session_id, record):
                restored = True
                # The restored checkpoint is the current one: a turn that changes
                # nothing need not upload it again.
                current = checkpoint_key(session_id)
                if record.checkpoint_key != current:  # usually already so: no round trip
                    record = msgspec.structs.replace(record, checkpoint_key=current)
                    await self.registry.put(lease, record)
            await self._deliver_inputs(handle, request, session_id=session_id)
            result = await handle.runner.execute(
                request, session_id=session_id, timeout_s=self._turn_timeout(request)
            )
        except (LockLostError, asyncio.CancelledError):
            # The job may still be running (closing a socket does not stop it):
            # recycle the sandbox instead of reusing one that may be dirty.
            await self._shielded(self._recycle(session_id, handle, lease, record))
            raise
        except (SandboxUnavailableError, SandboxTimeoutError):
            # Unreachable, or timed out while the job may still run: never reuse it.
            await self._shielded(self._recycle(session_id, handle, lease, record))
            raise
        self.metrics.inc("sandcell_executions_total", status=str(result.status))
        # A fresh sandbox that restored nothing and received no inputs holds only what
        # the job made: if it changed nothing, there is nothing to save.
        pristine = launched and not restored and not request.files and not request.inline_files
        record = await self._checkpoint(
            handle, session_id, lease, record, result, pristine=pristine
        )
        await self.registry.touch(session_id, at_s=self._now())
        return result

    async def _reuse(self, session_id: str, record: SessionRecord | None) -> SandboxHandle | None:
        """The session's live sandbox, or None (an unreachable one is destroyed)."""
        if record is None or record.state != "active" or record.provider != self.provider.name:
            return None
        handle = self._handles.get(session_id)
        if handle is not None and handle.sandbox_id != record.sandbox_id:
            # Another worker relaunched the session: our client points at a dead sandbox.
            del self._handles[session_id]
            await handle.close()
            handle = None
        if handle is None:
            try:
                handle = rebind(await self.provider.connect(record.sandbox_id), session_id)
            except (SandboxNotFoundError, SandboxUnavailableError):
                handle = None
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
        self.metrics.inc("sandcell_fallbacks_total", reason="sandbox_lost")
        self._handles.pop(session_id, None)
        if handle is not None:
            await handle.close()
        await self.provider.destroy(record.sandbox_id)
        return None

    async def _launch_for_session(
        self, session_id: str, previous: SessionRecord | None, lease: Lease
    ) -> tuple[SandboxHandle, SessionRecord]:
        stale = self._handles.pop(session_id, None)
        if stale is not None:
            # Ours, but no record points at it any more (lost or corrupt): never orphan it.
            await self._shielded(self._discard(stale))
        generation = await self.registry.next_generation(session_id)
        spec = dataclasses.replace(
            self.spec, labels={**self.spec.labels, SESSION_LABEL: session_id}
        )
        handle = rebind(await self._launch(spec), session_id)
        now = self._now()
        record = SessionRecord(
            session_id=session_id,
            provider=self.provider.name,
            sandbox_id=handle.sandbox_id,
            sandbox_uuid=str(uuid.uuid4()),
            endpoint=handle.endpoint,
            generation=generation,
            checkpoint_key=previous.checkpoint_key if previous else None,
            state="active",
            created_at_s=previous.created_at_s if previous else now,
            updated_at_s=now,
        )
        try:
            await self.registry.put(lease, record)
        except BaseException:
            # Fenced (or the registry failed): never leave an orphan behind.
            await self._shielded(self._discard(handle))
            raise
        self._handles[session_id] = handle
        return handle, record

    async def _restore(self, handle: SandboxHandle, session_id: str, record: SessionRecord) -> bool:
        """Restore before the first execute; never let the turn run on an empty workspace.

        Returns whether a checkpoint was restored (False: the session has none yet).
        """
        key = checkpoint_key(session_id)
        try:
            if record.checkpoint_key is None and not await self.store.exists(key):
                return False
            async with self.store.get(key, max_bytes=self.checkpoint_max_bytes) as snapshot:
                await handle.runner.restore(
                    snapshot.chunks,
                    session_id=session_id,
                    sha256=snapshot.info.sha256,
                    timeout_s=self.budgets.checkpoint_s,
                )
        except SnapshotNotFoundError:
            if record.checkpoint_key is None:
                return False
            self.metrics.inc("sandcell_restores_total", outcome="missing")
            await self._drop(session_id, handle)
            raise CheckpointError(f"session {session_id[:11]}: its checkpoint is missing") from None
        except ArchiveRejectedError:
            self.metrics.inc("sandcell_restores_total", outcome="rejected")
            await self._drop(session_id, handle)
            raise
        except (CheckpointError, SandboxError) as exc:
            self.metrics.inc("sandcell_restores_total", outcome="failed")
            await self._drop(session_id, handle)
            raise SandboxUnavailableError(
                f"restore failed ({type(exc).__name__}); the turn did not run, retry"
            ) from exc
        self.metrics.inc("sandcell_restores_total", outcome="ok")
        return True

    async def _checkpoint(
        self,
        handle: SandboxHandle,
        session_id: str,
        lease: Lease,
        record: SessionRecord,
        result: ExecuteResult,
        *,
        pristine: bool = False,
    ) -> SessionRecord:
        """Best-effort: a failure is logged and counted; the previous checkpoint stays."""
        if result.workspace_changed is False and (record.checkpoint_key is not None or pristine):
            self.metrics.inc("sandcell_checkpoints_total", outcome="unchanged")
            return record
        key = checkpoint_key(session_id)
        try:
            current = await self.registry.current_generation(session_id)
            if current != record.generation:
                raise FencedError(
                    "a newer launch owns this session",
                    generation=record.generation,
                    current_generation=current,
                )
            async with asyncio.timeout(self.budgets.checkpoint_s):
                async with handle.runner.checkpoint(session_id=session_id) as chunks:
                    info = await self.store.put(key, chunks, max_bytes=self.checkpoint_max_bytes)
        except LockLostError:
            raise
        except (
            CheckpointError,
            SandboxError,
            SessionBusyError,
            SessionConflictError,
            TimeoutError,
        ) as exc:
            self.metrics.inc("sandcell_checkpoints_total", outcome="failed")
            log.warning(
                "session %s: checkpoint failed (%s); keeping the previous one",
                session_id[:11],
                type(exc).__name__,
            )
            return record
        self.metrics.inc("sandcell_checkpoints_total", outcome="ok")
        self.metrics.inc("sandcell_checkpoint_bytes_total", info.size)
        updated = msgspec.structs.replace(record, checkpoint_key=key, updated_at_s=self._now())
        await self.registry.put(lease, updated)
        return updated

    async def _deliver_inputs(
        self, handle: SandboxHandle, request: ExecuteRequest, *, session_id: str | None
    ) -> None:
        """Probe the runner's input cache and push only the objects it lacks."""
        if not request.files:
            return
        missing = await handle.runner.probe_inputs(request.files, session_id=session_id)
        if not missing:
            return
        if self.inputs is None:
            return  # the runner reports input_missing naming the ref
        payloads: dict[tuple[str, str], InputPayload] = {}
        for ref in missing:
            key = (ref.storage_session, ref.object_id)
            if key not in payloads:
                payloads[key] = InputPayload(
                    storage_session=ref.storage_session,
                    object_id=ref.object_id,
                    data=await self.inputs.read(ref),
                    read_only=ref.read_only,
                )
        await handle.runner.push_inputs(list(payloads.values()), session_id=session_id)

    # -- lifecycle helpers ------------------------------------------------------

    async def _shielded(self, cleanup: Coroutine[Any, Any, None]) -> None:
        """Run cleanup to completion even while the caller is being cancelled.

        The task is kept referenced (the loop holds tasks only weakly) and awaited
        inside a shielded anyio scope, so neither a lost lease (an anyio scope) nor
        a plain ``task.cancel()`` can stop it half-way.
        """
        task = asyncio.ensure_future(cleanup)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        with anyio.CancelScope(shield=True):
            await asyncio.shield(task)

    async def _launch(self, spec: SandboxSpec) -> SandboxHandle:
        try:
            async with asyncio.timeout(self.budgets.launch_s + self.budgets.health_s):
                handle = await self.provider.create(spec)
        except TimeoutError:
            self.metrics.inc("sandcell_launches_total", outcome="timeout")
            raise SandboxUnavailableError("sandbox launch timed out") from None
        except SandboxError:
            self.metrics.inc("sandcell_launches_total", outcome="failed")
            raise
        self.metrics.inc("sandcell_launches_total", outcome="ok")
        return handle

    async def _discard(self, handle: SandboxHandle) -> None:
        with contextlib.suppress(Exception):
            await handle.close()
        try:
            await self.provider.destroy(handle.sandbox_id)
        except SandboxError as exc:
            log.warning("destroy of %s failed: %s", handle.sandbox_id, exc)

    async def _drop(self, session_id: str, handle: SandboxHandle) -> None:
        """Destroy a fresh sandbox whose restore failed and forget it (record kept)."""
        self._handles.pop(session_id, None)
        await self._shielded(self._discard(handle))

    async def _recycle(
        self, session_id: str, handle: SandboxHandle, lease: Lease, record: SessionRecord
    ) -> None:
        self.metrics.inc("sandcell_fallbacks_total", reason="recycled")
        self._handles.pop(session_id, None)
        await self._discard(handle)
        with contextlib.suppress(Exception):
            await self.registry.put(
                lease, msgspec.structs.replace(record, state="suspended", updated_at_s=self._now())
            )

    def _turn_timeout(self, request: ExecuteRequest) -> float:
        return request.timeout_ms / 1000 + self.budgets.health_s

    async def aclose(self, *, destroy_sandboxes: bool) -> None:
        """Close clients; with ``destroy_sandboxes`` also destroy every active sandbox.

        The embedded (in-process) registry dies with this process, so its sandboxes
        must go too; their checkpoints stay in the snapshot store.
        """
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            with contextlib.suppress(Exception):
                await handle.close()
        if destroy_sandboxes:
            for record in await self.registry.list_records():
                if record.state == "active" and record.provider == self.provider.name:
                    with contextlib.suppress(SandboxError):
                        await self.provider.destroy(record.sandbox_id)
