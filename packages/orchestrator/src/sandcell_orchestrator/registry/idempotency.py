"""Idempotency keys: requests claimed, and the answers they gave, shared by every worker.

``IdempotencyEntry`` is what a claim finds; ``IdempotencyStore`` is what a
registry backend implements (``sqlite_idempotency``, ``redis_idempotency``,
``memory``). ``serve/idempotency.py`` builds the HTTP behaviour on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import msgspec

__all__ = [
    "IdempotencyEntry",
    "IdempotencyStore",
    "IdempotentAnswer",
    "validate_idempotency_key",
]


class IdempotencyEntry(msgspec.Struct, frozen=True, kw_only=True):
    """What a registry holds for an idempotency key someone else already claimed.

    ``done`` is false while the first request still runs (``status`` 0, ``body``
    empty); then ``status`` and ``body`` are the answer it gave, replayed as is.
    """

    fingerprint: str
    done: bool
    status: int
    body: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class IdempotentAnswer:
    """A claimed key's answer, stored by the fenced record write that commits its turn
    (``SessionStore.put``): a committed turn always has its answer, so a retry never
    runs it again. Stored only if ``token`` still holds the claim on ``key``; kept
    ``ttl_ms``. The token is the claim's secret and the body a tenant's output:
    ``repr`` shows neither."""

    key: str
    token: str = field(repr=False)
    status: int
    body: bytes = field(repr=False)
    ttl_ms: int

    def __post_init__(self) -> None:
        validate_idempotency_key(self.key)
        if self.ttl_ms <= 0:
            raise ValueError("ttl_ms: must be > 0")


def validate_idempotency_key(key: str) -> str:
    """Return ``key`` if it is a stored idempotency key (64 lowercase hex digits).

    Callers hash what clients send (tenant, route, header) into one; nothing a
    client names reaches a storage key unhashed.
    """
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError("idempotency key: must be 64 lowercase hex digits")
    return key


@runtime_checkable
class IdempotencyStore(Protocol):
    """Claims on idempotency keys (64 hex digits) and the answers stored under them."""

    async def claim_idempotency(
        self, key: str, *, fingerprint: str, token: str, ttl_ms: int
    ) -> IdempotencyEntry | None:
        """Claim ``key`` for ``token`` for ``ttl_ms`` if nobody has (``None``); else its entry.

        Atomic: of two concurrent claims exactly one gets ``None``.
        """
        ...

    async def renew_idempotency(self, key: str, *, token: str, ttl_ms: int) -> bool:
        """Keep a pending claim of ``token`` alive for ``ttl_ms``; ``False`` if it is not ours."""
        ...

    async def finish_idempotency(
        self, key: str, *, token: str, status: int, body: bytes, ttl_ms: int
    ) -> bool:
        """Store the answer of ``token``'s claim, kept ``ttl_ms``; ``False`` if not ours."""
        ...

    async def drop_idempotency(self, key: str, *, token: str) -> bool:
        """Forget ``token``'s pending claim (the request failed: a retry runs again)."""
        ...
