"""Fleet-wide slots in this process's memory (``SlotCounter`` of ``InProcessRegistry``)."""

from __future__ import annotations

from collections.abc import Callable

import anyio

from .core import check_ttl
from .slots import validate_slot_scope

__all__ = ["InProcessSlots"]


class InProcessSlots:
    """``SlotCounter`` in a dict: scope -> token -> expires at, by ``_clock``."""

    _clock: Callable[[], float]

    def __init__(self) -> None:
        self._slots: dict[str, dict[str, float]] = {}

    def _live_slots(self, scope: str) -> dict[str, float]:
        validate_slot_scope(scope)
        now = self._clock()
        held = {t: at for t, at in self._slots.get(scope, {}).items() if at > now}
        self._slots[scope] = held
        return held

    async def acquire_slot(self, scope: str, *, token: str, limit: int, ttl_ms: int) -> bool:
        """Take a slot if fewer than ``limit`` are held."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        held = self._live_slots(scope)
        if len(held) >= limit:
            return False
        held[token] = self._clock() + ttl_ms / 1000
        return True

    async def renew_slot(self, scope: str, *, token: str, ttl_ms: int) -> bool:
        """Extend ``token``'s live slot."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        held = self._live_slots(scope)
        if token not in held:
            return False
        held[token] = self._clock() + ttl_ms / 1000
        return True

    async def release_slot(self, scope: str, *, token: str) -> None:
        """Give ``token``'s slot back."""
        await anyio.lowlevel.checkpoint()
        self._live_slots(scope).pop(token, None)

    async def slots_held(self, scope: str) -> int:
        """Live slots of ``scope``."""
        await anyio.lowlevel.checkpoint()
        return len(self._live_slots(scope))
