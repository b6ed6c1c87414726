"""Per-tenant concurrency: past the limit a call is answered 429 ``rate_limited`` at once.

The count is the fleet's: each run holds a slot in the registry (``SlotCounter``,
Redis in production) for its tenant, so several workers behind a load balancer
admit ``SANDCELL_LIBRECHAT_MAX_CONCURRENT`` runs per tenant between them. A slot
is renewed while its run lasts and lapses ``SANDCELL_LIBRECHAT_SLOT_TTL_S`` after
its worker stopped renewing it (the worker crashed), so no slot is held forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable

import anyio

from ...errors import RegistryError
from ...registry import SlotCounter

__all__ = ["RateLimitedError", "TenantLimiter"]

log = logging.getLogger(__name__)


class RateLimitedError(Exception):
    """The tenant has ``limit`` runs in flight; retry after ``retry_after_s``."""

    def __init__(self, *, retry_after_s: int) -> None:
        super().__init__("too many concurrent runs for this tenant")
        self.retry_after_s = retry_after_s


class TenantLimiter:
    """At most ``limit`` concurrent slots per namespace, counted in ``registry``."""

    def __init__(
        self,
        limit: int,
        *,
        registry: Callable[[], SlotCounter],
        ttl_s: float = 30.0,
        retry_after_s: int = 1,
    ) -> None:
        self._limit = limit
        self._registry = registry
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._retry_after_s = retry_after_s

    @staticmethod
    def scope(namespace: str) -> str:
        """The stored scope of ``namespace``'s slots (a hash: any text is a namespace)."""
        return hashlib.sha256(f"librechat/runs\0{namespace}".encode()).hexdigest()

    async def running(self, namespace: str) -> int:
        """The tenant's runs in flight, fleet-wide."""
        return await self._registry().slots_held(self.scope(namespace))

    @contextlib.asynccontextmanager
    async def slot(self, namespace: str) -> AsyncIterator[None]:
        """Hold one of the tenant's slots for the block; ``RateLimitedError`` if none is
        free (``RegistryError`` if the registry cannot say)."""
        registry, scope, token = self._registry(), self.scope(namespace), secrets.token_hex(16)
        taken = await registry.acquire_slot(
            scope, token=token, limit=self._limit, ttl_ms=self._ttl_ms
        )
        if not taken:
            raise RateLimitedError(retry_after_s=self._retry_after_s)
        renewer = asyncio.create_task(self._renew(registry, scope, token))
        try:
            yield
        finally:
            renewer.cancel()
            with contextlib.suppress(RegistryError), anyio.CancelScope(shield=True):
                await registry.release_slot(scope, token=token)

    async def _renew(self, registry: SlotCounter, scope: str, token: str) -> None:
        while True:
            await asyncio.sleep(self._ttl_ms / 3000)
            try:
                if not await registry.renew_slot(scope, token=token, ttl_ms=self._ttl_ms):
                    # Lapsed (the registry was unreachable for a TTL): the run goes on,
                    # uncounted, rather than failing a turn the user is waiting for.
                    log.warning("a LibreChat run's concurrency slot lapsed")
                    return
            except RegistryError as exc:
                log.warning("could not renew a LibreChat concurrency slot: %s", exc)
