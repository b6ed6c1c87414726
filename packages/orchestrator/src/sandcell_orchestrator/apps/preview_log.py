"""Preview upstream failures: counted every time, logged at INFO once per run of them.

A browser polling a dev server that is still starting (a hot-reload client
reconnects every second or so) fails the same way on every request; an INFO
line each time buried everything else in the log. An instance's first failure
of a kind is INFO; repeats are DEBUG until a request of that kind gets through
or ``window_s`` has passed, when the next INFO line says how many it stood for.
``sandcell_preview_upstream_failures_total{kind}`` counts them all.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from ..metrics import Metrics

__all__ = ["FAILURES_METRIC", "Kind", "UpstreamFailures"]

log = logging.getLogger("sandcell_orchestrator.apps.preview")

FAILURES_METRIC = "sandcell_preview_upstream_failures_total"
Kind = Literal["http", "websocket"]


class UpstreamFailures:
    """Per (instance, kind): when the last INFO line was, and how many repeats since."""

    def __init__(
        self,
        *,
        window_s: float = 60.0,
        max_tracked: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window_s = window_s
        # Bounded: one entry per failing instance, the least recently failing dropped
        # (it only loses its repeat count: its next failure is INFO again).
        self._max_tracked = max_tracked
        self._clock = clock
        self._runs: OrderedDict[tuple[str, Kind], list[float]] = OrderedDict()

    def failed(
        self, instance_id: str, kind: Kind, what: str, reason: str, metrics: Metrics | None
    ) -> None:
        """Count one failure; log it at INFO if it starts a run (or a window), else DEBUG."""
        if metrics is not None:
            metrics.inc(FAILURES_METRIC, kind=kind)
        key = (instance_id, kind)
        now = self._clock()
        run = self._runs.get(key)
        if run is not None and now - run[0] < self._window_s:
            run[1] += 1
            log.debug("preview %s: %s: %s (repeat %d)", instance_id, what, reason, int(run[1]))
            return
        if run is not None and run[1]:
            log.info(
                "preview %s: %s: %s (%d more in the last %.0f s, at DEBUG)",
                instance_id,
                what,
                reason,
                int(run[1]),
                now - run[0],
            )
        else:
            log.info("preview %s: %s: %s", instance_id, what, reason)
        self._runs[key] = [now, 0]
        self._runs.move_to_end(key)
        while len(self._runs) > self._max_tracked:
            self._runs.popitem(last=False)

    def succeeded(self, instance_id: str, kind: Kind) -> None:
        """A request got through: the next failure of this kind starts a new run (INFO)."""
        if self._runs:
            self._runs.pop((instance_id, kind), None)
