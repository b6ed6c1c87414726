"""SandboxManager: acquire, resume, suspend and destroy sandboxes by a stable id.

The registry row of a sandbox is keyed by a session id derived from its stable
``sandbox_uuid``; the provider's own id may change across resume and the row is
rewritten. Suspend policy comes from ``provider.capabilities.pause_resume``:
native suspend in place, or persist, **then** destroy, **then** mark suspended,
so a failure at any step leaves the sandbox retryable. Feature code never
branches on the provider.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import Callable

import msgspec

from ..errors import CheckpointError, SandboxNotFoundError
from ..handle import SandboxHandle
from ..providers.base import (
    SESSION_LABEL,
    NativeSnapshot,
    ObjectSnapshot,
    PersistentWorkspace,
    SandboxProvider,
    SandboxSpec,
    SnapshotRef,
)
from ..registry import SessionRecord, SessionRegistry
from ..registry.lease import hold_session

log = logging.getLogger(__name__)


def sandbox_session_key(sandbox_uuid: str) -> str:
    """The registry key (a runtime-session-shaped id) of a manager-owned sandbox."""
    return "rt_" + hashlib.sha256(b"sandbox-uuid\x00" + sandbox_uuid.encode()).hexdigest()


def snapshot_key(sandbox_uuid: str) -> str:
    return f"snapshots/{sandbox_session_key(sandbox_uuid)}.tar.gz"


class SandboxManager:
    """Provider-neutral lifecycle of sandboxes, recorded in the session registry."""

    def __init__(
        self,
        provider: SandboxProvider,
        registry: SessionRegistry,
        *,
        lock_ttl_ms: int = 120_000,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.provider = provider
        self.registry = registry
        self._ttl_ms = lock_ttl_ms
        self._now = wall_clock

    async def acquire(
        self, spec: SandboxSpec, *, owner: str, workspace: PersistentWorkspace | None = None
    ) -> tuple[str, SandboxHandle]:
        """Create and register a sandbox; returns ``(sandbox_uuid, handle)``.

        If registering fails, the new sandbox is destroyed, not orphaned.
        """
        sandbox_uuid = str(uuid.uuid4())
        key = sandbox_session_key(sandbox_uuid)
        labelled = _with_label(spec, key, owner)
        handle = await self.provider.create(labelled)
        try:
            async with hold_session(self.registry, key, ttl_ms=self._ttl_ms) as lease:
                generation = await self.registry.next_generation(key)
                now = self._now()
                await self.registry.put(
                    lease,
                    SessionRecord(
                        session_id=key,
                        provider=self.provider.name,
                        sandbox_id=handle.sandbox_id,
                        sandbox_uuid=sandbox_uuid,
                        endpoint=handle.endpoint,
                        generation=generation,
                        checkpoint_key=None,
                        state="active",
                        created_at_s=now,
                        updated_at_s=now,
                    ),
                )
        except BaseException:
            await handle.close()
            await self.provider.destroy(handle.sandbox_id)
            raise
        return sandbox_uuid, handle

    async def get_record(self, sandbox_uuid: str) -> SessionRecord | None:
        return await self.registry.get(sandbox_session_key(sandbox_uuid))

    async def connect(self, sandbox_uuid: str) -> SandboxHandle:
        """A handle to an active sandbox; ``SandboxNotFoundError`` if suspended or gone."""
        record = await self.get_record(sandbox_uuid)
        if record is None or record.state != "active":
            raise SandboxNotFoundError(f"sandbox {sandbox_uuid} is not active")
        return rebind(await self.provider.connect(record.sandbox_id), record.session_id)

    async def suspend_by_uuid(
        self, sandbox_uuid: str, *, workspace: PersistentWorkspace | None = None
    ) -> None:
        handle = await self.connect(sandbox_uuid)
        try:
            await self.suspend(handle, sandbox_uuid=sandbox_uuid, workspace=workspace)
        finally:
            await handle.close()

    async def suspend(
        self,
        handle: SandboxHandle,
        *,
        sandbox_uuid: str,
        workspace: PersistentWorkspace | None = None,
    ) -> SnapshotRef:
        """Native suspend in place, or persist → destroy → mark suspended."""
        key = sandbox_session_key(sandbox_uuid)
        async with hold_session(self.registry, key, ttl_ms=self._ttl_ms) as lease:
            record = await self.registry.get(key)
            if record is None:
                raise SandboxNotFoundError(f"sandbox {sandbox_uuid} is not registered")
            ref = await self.provider.persist(
                handle, workspace or PersistentWorkspace(), key=snapshot_key(sandbox_uuid)
            )
            if not self.provider.capabilities.pause_resume:
                await self.provider.destroy(handle.sandbox_id)
            checkpoint = ref.key if isinstance(ref, ObjectSnapshot) else None
            await self.registry.put(
                lease,
                _replace(record, state="suspended", checkpoint_key=checkpoint, at=self._now()),
            )
        return ref

    async def checkpoint(
        self,
        handle: SandboxHandle,
        *,
        sandbox_uuid: str,
        workspace: PersistentWorkspace | None = None,
    ) -> ObjectSnapshot | None:
        """Save a running sandbox's workspace, which keeps running; the row points at it.

        After this, ``replace_lost`` (or ``resume`` of a suspended row) restores from
        the saved copy. Providers whose ``persist`` is a native suspend have no live
        copy to offer: they return ``None`` and the sandbox is left untouched.
        """
        if self.provider.capabilities.pause_resume:
            return None
        key = sandbox_session_key(sandbox_uuid)
        async with hold_session(self.registry, key, ttl_ms=self._ttl_ms) as lease:
            record = await self.registry.get(key)
            if record is None or record.state != "active":
                raise SandboxNotFoundError(f"sandbox {sandbox_uuid} is not active")
            ref = await self.provider.persist(
                handle, workspace or PersistentWorkspace(), key=snapshot_key(sandbox_uuid)
            )
            if not isinstance(ref, ObjectSnapshot):
                raise CheckpointError(f"provider {self.provider.name} made no stored checkpoint")
            if record.checkpoint_key != ref.key:
                await self.registry.put(
                    lease, _replace(record, checkpoint_key=ref.key, at=self._now())
                )
        return ref

    async def replace_lost(self, sandbox_uuid: str, spec: SandboxSpec) -> SandboxHandle:
        """Recreate a sandbox that stopped answering from its last checkpoint.

        Whatever is left of the old sandbox is destroyed and the row marked
        suspended first (the order ``suspend`` uses), so a failure at any step
        leaves a row the next attempt can resume. ``CheckpointError`` when the
        sandbox was never checkpointed: there is nothing to rebuild it from.
        """
        key = sandbox_session_key(sandbox_uuid)
        async with hold_session(self.registry, key, ttl_ms=self._ttl_ms) as lease:
            record = await self.registry.get(key)
            if record is None:
                raise SandboxNotFoundError(f"sandbox {sandbox_uuid} is not registered")
            if record.checkpoint_key is None:
                raise CheckpointError(f"sandbox {sandbox_uuid} has no checkpoint to rebuild from")
            # Destroy even a row already marked suspended (a sweeper marks lost
            # sandboxes so): its remains still need removing.
            await self.provider.destroy(record.sandbox_id)
            if record.state == "active":
                await self.registry.put(lease, _replace(record, state="suspended", at=self._now()))
        return await self.resume(sandbox_uuid, spec)

    async def resume(self, sandbox_uuid: str, spec: SandboxSpec) -> SandboxHandle:
        """Re-materialise a suspended sandbox by its stable id (its provider id may change)."""
        key = sandbox_session_key(sandbox_uuid)
        async with hold_session(self.registry, key, ttl_ms=self._ttl_ms) as lease:
            record = await self.registry.get(key)
            if record is None:
                raise SandboxNotFoundError(f"sandbox {sandbox_uuid} is not registered")
            if record.state == "active":
                return rebind(await self.provider.connect(record.sandbox_id), key)
            ref: SnapshotRef
            if record.checkpoint_key is not None:
                ref = ObjectSnapshot(key=record.checkpoint_key)
            else:
                ref = NativeSnapshot(provider=self.provider.name, sandbox_id=record.sandbox_id)
            handle = await self.provider.resume(ref, _with_label(spec, key, None))
            try:
                await self.registry.put(
                    lease,
                    _replace(
                        record,
                        state="active",
                        sandbox_id=handle.sandbox_id,
                        endpoint=handle.endpoint,
                        at=self._now(),
                    ),
                )
            except BaseException:
                await handle.close()
                await self.provider.destroy(handle.sandbox_id)
                raise
            return rebind(handle, key)

    async def destroy(self, sandbox_uuid: str) -> None:
        """Kill the sandbox, delete its snapshot, drop its row (idempotent)."""
        key = sandbox_session_key(sandbox_uuid)
        async with hold_session(self.registry, key, ttl_ms=self._ttl_ms) as lease:
            record = await self.registry.get(key)
            if record is None:
                return
            await self.provider.destroy(record.sandbox_id)
            if record.checkpoint_key is not None:
                await self.provider.delete_snapshot(ObjectSnapshot(key=record.checkpoint_key))
            elif record.state == "suspended":
                await self.provider.delete_snapshot(
                    NativeSnapshot(provider=self.provider.name, sandbox_id=record.sandbox_id)
                )
            await self.registry.delete(lease, key, generation=record.generation)


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


def _with_label(spec: SandboxSpec, session_id: str, owner: str | None) -> SandboxSpec:
    labels = {**spec.labels, SESSION_LABEL: session_id}
    if owner is not None:
        labels["sandcell.owner"] = owner
    return dataclasses.replace(spec, labels=labels)


def _replace(
    record: SessionRecord,
    *,
    at: float,
    state: str | None = None,
    checkpoint_key: str | None = None,
    sandbox_id: str | None = None,
    endpoint: str | None = None,
) -> SessionRecord:
    changes: dict[str, object] = {"updated_at_s": at}
    if state is not None:
        changes["state"] = state
    if checkpoint_key is not None:
        changes["checkpoint_key"] = checkpoint_key
    if sandbox_id is not None:
        changes["sandbox_id"] = sandbox_id
    if endpoint is not None:
        changes["endpoint"] = endpoint
    return msgspec.structs.replace(record, **changes)
