"""Sandboxes' egress policies as the lifecycle sets them, and their counters in the metrics.

A policy is set on a sandbox's runner (``PUT /v1/egress``) when it is launched
with one, when a turn carries one, or when the session route replaces it. From
then on the sandbox is *tracked*: after each turn its runner's counters are read
(``GET /v1/egress``, which first waits for the gateways' pending decisions) and
the differences go to ``sandcell_egress_allowed_total`` and
``sandcell_egress_refused_total``; each new refusal is logged with its
destination. Sandboxes never given a policy cost nothing.
"""

from __future__ import annotations

import logging

from sandcell_protocol import EgressPolicy, EgressStatus

from ..errors import SandcellError
from ..handle import SandboxHandle
from ..metrics import Metrics

log = logging.getLogger(__name__)

_MAX_TRACKED = 10_000


class EgressTracker:
    """See the module docstring."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._seen: dict[str, tuple[int, int]] = {}

    async def apply(self, handle: SandboxHandle, policy: EgressPolicy) -> EgressStatus:
        """Set ``policy`` on the sandbox (it decides the next connection) and track it."""
        status = await handle.runner.set_egress(policy)
        if len(self._seen) >= _MAX_TRACKED:
            self._seen.clear()
        self._seen.setdefault(handle.sandbox_id, (0, 0))
        return status

    async def count(self, handle: SandboxHandle) -> None:
        """Add a tracked sandbox's new decisions to the metrics; never fails a turn."""
        if handle.sandbox_id not in self._seen:
            return
        try:
            status = await handle.runner.egress()
        except SandcellError as exc:
            log.debug("egress counters of %s not read: %s", handle.sandbox_id[:12], exc)
            return
        self._add(handle, status)

    async def status(self, handle: SandboxHandle) -> EgressStatus:
        """The sandbox's policy, counters and latest refusals (the metrics catch up too)."""
        status = await handle.runner.egress()
        if handle.sandbox_id in self._seen:
            self._add(handle, status)
        return status

    def _add(self, handle: SandboxHandle, status: EgressStatus) -> None:
        seen = self._seen.get(handle.sandbox_id, (0, 0))
        allowed, refused = status.allowed_total - seen[0], status.refused_total - seen[1]
        if allowed > 0:
            self._metrics.inc("sandcell_egress_allowed_total", allowed)
        if refused > 0:
            self._metrics.inc("sandcell_egress_refused_total", refused)
            for event in status.recent_refused[-refused:]:
                log.info(
                    "sandbox %s: egress refused (%s): %s %s port %d",
                    handle.sandbox_id[:12],
                    event.reason,
                    event.name or "-",
                    event.address or "-",
                    event.port,
                )
        self._seen[handle.sandbox_id] = (status.allowed_total, status.refused_total)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone."""
        self._seen.pop(sandbox_id, None)


__all__ = ["EgressTracker"]
