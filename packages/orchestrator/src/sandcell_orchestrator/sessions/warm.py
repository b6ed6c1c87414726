"""``WarmLimit``: at most ``max_per_tenant`` warm sandboxes of one tenant on this worker.

A session's sandbox stays warm after its turn until the idle sweep suspends it
(``SANDCELL_IDLE_TIMEOUT_S``, 30 min by default), so a tenant that named a new
session on each call held one more runner per call (about 50 MB and three processes
each on the local provider: 20 calls, 60 processes) for half an hour, and a few
hundred calls took the host's memory from every tenant. Past the limit the tenant's
least recently used warm session is suspended once the turn that went past it is
done (its workspace is in its checkpoint already: only code contexts' variables are
lost, as after an idle suspend, and a session in a turn is passed over), so a tenant
pays for its own overflow. Counted in this process's memory: each worker holds at
most that many of a tenant's sandboxes.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable

from ..errors import SandcellError

__all__ = ["WarmLimit"]

log = logging.getLogger(__name__)


class WarmLimit:
    """Per tenant, its sessions by last use; the oldest past ``max_per_tenant`` suspended."""

    def __init__(self, suspend: Callable[[str], Awaitable[bool]], *, max_per_tenant: int) -> None:
        if max_per_tenant < 1:
            raise ValueError("WarmLimit: max_per_tenant must be at least 1")
        self._suspend = suspend
        self.max_per_tenant = max_per_tenant
        self._by_tenant: dict[str, collections.OrderedDict[str, None]] = {}

    async def used(self, namespace: str, session_id: str) -> None:
        """``session_id`` (``namespace``'s) just ended a turn warm: the tenant's least
        recently used sessions past the limit are suspended (a busy one, or one gone
        already, is passed over: its next turn counts it again)."""
        recent = self._by_tenant.setdefault(namespace, collections.OrderedDict())
        recent[session_id] = None
        recent.move_to_end(session_id)
        while len(recent) > self.max_per_tenant:
            oldest, _ = recent.popitem(last=False)
            try:
                if await self._suspend(oldest):
                    log.info(
                        "session %s suspended: its tenant's warm sandboxes past %d",
                        oldest[:11],
                        self.max_per_tenant,
                    )
            except SandcellError as exc:
                log.info("session %s not suspended: %s", oldest[:11], type(exc).__name__)
