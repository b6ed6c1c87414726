"""``SandboxMetrics``: a sandbox's metrics samples over its life, live and kept.

While a sandbox runs its runner holds a bounded ring of samples
(``runner/sandbox/metrics.py``); a pause copies the ring into the snapshot store
(``history.MetricsHistory``), where ``get_metrics`` reads it back merged with the
live ring after a resume. A kill retires them (the ring's last samples too): a
killed sandbox's ``get_metrics`` answers them, as E2B's does, for a bounded time.
"""

from __future__ import annotations

import logging

from sandcell_protocol.sandbox_messages import MetricsQuery, MetricsSample

from ..errors import SandcellError
from .history import MetricsHistory, in_range, merge_samples
from .sandbox import E2bSandbox, valid_sandbox_id
from .views import SandboxViews

__all__ = ["SandboxMetrics"]

log = logging.getLogger(__name__)


class SandboxMetrics:
    """The samples of tenants' sandboxes: their runners' and those their pauses kept."""

    def __init__(self, history: MetricsHistory, *, views: SandboxViews) -> None:
        self._history = history
        self._views = views

    async def read(self, sandbox: E2bSandbox, query: MetricsQuery) -> list[MetricsSample]:
        """The samples in the query's range, oldest first: those its pauses kept
        (``history.MetricsHistory``) and, while it runs, its runner's ring."""
        kept: list[MetricsSample] = []
        if sandbox.row.resumes or sandbox.state == "paused":
            # Only a sandbox that was ever paused has kept samples: no store read else.
            kept = in_range(await self._history.read(sandbox.owner, sandbox.sandbox_id), query)
        if sandbox.state != "running":
            return kept
        runner = (await self._views.attach(sandbox)).runner
        if runner is None:
            return kept  # a runner this worker's provider cannot reach (logged by attach)
        return merge_samples(kept, (await runner.metrics(query)).samples)

    async def keep(self, sandbox: E2bSandbox) -> None:
        """Before a pause: the runner's samples into the kept ones (best effort: a
        runner or store that fails loses them, never the pause)."""
        runner = sandbox.runner
        if runner is None:
            return
        try:
            samples = (await runner.metrics(MetricsQuery())).samples
        except SandcellError as exc:
            log.warning("e2b sandbox %s: metrics not kept: %s", sandbox.sandbox_id, exc)
            return
        await self._history.keep(sandbox.owner, sandbox.sandbox_id, samples)

    async def retire(self, sandbox: E2bSandbox) -> None:
        """At a kill, before its runner goes: its samples, the ring's (when this worker
        reaches the runner) with those its pauses kept, retired (best effort)."""
        samples: list[MetricsSample] = []
        runner = sandbox.runner if sandbox.state == "running" else None
        if runner is not None:
            try:
                samples = (await runner.metrics(MetricsQuery())).samples
            except SandcellError as exc:
                log.warning("e2b sandbox %s: last metrics not read: %s", sandbox.sandbox_id, exc)
        await self._history.retire(sandbox.owner, sandbox.sandbox_id, samples)

    async def read_killed(
        self, owner: str, sandbox_id: str, query: MetricsQuery
    ) -> list[MetricsSample]:
        """The query's range of ``owner``'s killed sandbox's retired samples, oldest
        first: none for one it never had (unknown and another tenant's alike)."""
        if not valid_sandbox_id(sandbox_id):
            return []
        return in_range(await self._history.read_killed(owner, sandbox_id), query)
