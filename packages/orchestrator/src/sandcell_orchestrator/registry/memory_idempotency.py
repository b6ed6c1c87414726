"""Keyed requests and their answers in this process's memory (``IdempotencyStore`` of
``InProcessRegistry``).

A claim expires ``ttl_ms`` after it was taken or renewed, an answer ``ttl_ms``
after it was stored, by the registry's ``clock``.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from .core import check_ttl
from .idempotency import IdempotencyEntry, validate_idempotency_key

__all__ = ["InProcessIdempotency"]


class InProcessIdempotency:
    """``IdempotencyStore`` in a dict: key -> (token, entry, expires at by ``_clock``)."""

    _clock: Callable[[], float]

    def __init__(self) -> None:
        self._idempotency: dict[str, tuple[str, IdempotencyEntry, float]] = {}

    def _idempotent(self, key: str) -> tuple[str, IdempotencyEntry, float] | None:
        validate_idempotency_key(key)
        held = self._idempotency.get(key)
        if held is not None and self._clock() >= held[2]:
            del self._idempotency[key]
            return None
        return held

    async def claim_idempotency(
        self, key: str, *, fingerprint: str, token: str, ttl_ms: int
    ) -> IdempotencyEntry | None:
        """Claim ``key`` unless someone has; else the entry found."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        held = self._idempotent(key)
        if held is not None:
            return held[1]
        pending = IdempotencyEntry(fingerprint=fingerprint, done=False, status=0, body=b"")
        self._idempotency[key] = (token, pending, self._clock() + ttl_ms / 1000)
        return None

    async def renew_idempotency(self, key: str, *, token: str, ttl_ms: int) -> bool:
        """Extend ``token``'s pending claim."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        held = self._idempotent(key)
        if held is None or held[0] != token or held[1].done:
            return False
        self._idempotency[key] = (token, held[1], self._clock() + ttl_ms / 1000)
        return True

    async def finish_idempotency(
        self, key: str, *, token: str, status: int, body: bytes, ttl_ms: int
    ) -> bool:
        """Store the answer of ``token``'s claim."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        return self._finish(key, token, status, body, ttl_ms)

    def _finish(self, key: str, token: str, status: int, body: bytes, ttl_ms: int) -> bool:
        held = self._idempotent(key)
        if held is None or held[0] != token:
            return False
        done = IdempotencyEntry(
            fingerprint=held[1].fingerprint, done=True, status=status, body=bytes(body)
        )
        self._idempotency[key] = (token, done, self._clock() + ttl_ms / 1000)
        return True

    async def drop_idempotency(self, key: str, *, token: str) -> bool:
        """Forget ``token``'s pending claim."""
        await anyio.lowlevel.checkpoint()
        held = self._idempotent(key)
        if held is None or held[0] != token or held[1].done:
            return False
        del self._idempotency[key]
        return True
