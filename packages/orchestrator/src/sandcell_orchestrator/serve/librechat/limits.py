"""Per-tenant concurrency: past the limit a call is answered 429 ``rate_limited`` at once.

The count is this process's: with several replicas behind a load balancer each
admits ``SANDCELL_LIBRECHAT_MAX_CONCURRENT`` runs per tenant (size it accordingly).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

__all__ = ["RateLimitedError", "TenantLimiter"]


class RateLimitedError(Exception):
    """The tenant has ``limit`` runs in flight; retry after ``retry_after_s``."""

    def __init__(self, *, retry_after_s: int) -> None:
        super().__init__("too many concurrent runs for this tenant")
        self.retry_after_s = retry_after_s


class TenantLimiter:
    """At most ``limit`` concurrent slots per namespace (single event loop: no lock)."""

    def __init__(self, limit: int, *, retry_after_s: int = 1) -> None:
        self._limit = limit
        self._retry_after_s = retry_after_s
        self._running: collections.Counter[str] = collections.Counter()

    def running(self, namespace: str) -> int:
        return self._running[namespace]

    @contextlib.contextmanager
    def slot(self, namespace: str) -> Iterator[None]:
        if self._running[namespace] >= self._limit:
            raise RateLimitedError(retry_after_s=self._retry_after_s)
        self._running[namespace] += 1
        try:
            yield
        finally:
            self._running[namespace] -= 1
            if not self._running[namespace]:
                del self._running[namespace]
