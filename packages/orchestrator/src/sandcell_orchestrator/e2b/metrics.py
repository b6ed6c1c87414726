"""``SandboxMetrics``: a sandbox's metrics samples over its life, live and kept.

While a sandbox runs its runner holds a bounded ring of samples
(``runner/sandbox/metrics.py``); a pause copies the ring into the snapshot store
(``history.MetricsHistory``), where ``get_metrics`` reads it back merged with the
live ring after a resume.
"""

from __future__ import annotations

import logging

from sandcell_protocol.sandbox_messages import MetricsQuery, MetricsSample

from ..errors import SandcellError
from .history import MetricsHistory, in_range, merge_samples
from .sandbox import E2bSandbox
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
