"""Fleet-wide slots: at most ``limit`` holders of one scope at a time, across workers.

A holder takes a slot under a random token for ``ttl_ms`` and renews it while it
works; a slot whose holder stopped renewing (its worker crashed) lapses after
``ttl_ms``, so no slot is held forever. ``SlotCounter`` is what a registry backend
implements (``sqlite_slots``, ``redis_slots``, ``memory``); LibreChat's per-tenant
concurrency limit is built on it (``serve/librechat/limits.py``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["SlotCounter", "validate_slot_scope"]


def validate_slot_scope(scope: str) -> str:
    """Return ``scope`` if it is a stored slot scope (64 lowercase hex digits: callers
    hash what they count by, so nothing a client names reaches a storage key)."""
    if len(scope) != 64 or any(c not in "0123456789abcdef" for c in scope):
        raise ValueError("slot scope: must be 64 lowercase hex digits")
    return scope


@runtime_checkable
class SlotCounter(Protocol):
    """Counted, expiring slots per scope."""

    async def acquire_slot(self, scope: str, *, token: str, limit: int, ttl_ms: int) -> bool:
        """Take a slot of ``scope`` for ``token`` for ``ttl_ms`` if fewer than ``limit``
        live ones are held; ``False`` if not. Atomic across workers."""
        ...

    async def renew_slot(self, scope: str, *, token: str, ttl_ms: int) -> bool:
        """Keep ``token``'s slot for another ``ttl_ms``; ``False`` if it lapsed."""
        ...

    async def release_slot(self, scope: str, *, token: str) -> None:
        """Give ``token``'s slot back (idempotent)."""
        ...

    async def slots_held(self, scope: str) -> int:
        """How many live slots ``scope`` has."""
        ...
