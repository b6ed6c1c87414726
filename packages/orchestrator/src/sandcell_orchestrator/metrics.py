"""Counters and duration histograms the orchestrator keeps, rendered as Prometheus text.

``open_services`` declares every series in ``METRIC_HELP`` / ``METRIC_SERIES`` /
``HISTOGRAMS`` up front, so ``/metrics`` shows each at 0 from the start (a rate
over a counter that appears only at its first increment misses that increment).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator


class Metrics:
    """Monotonic counters with optional labels; thread-safe, no dependencies."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        self._help: dict[str, str] = {}
        self._histograms: dict[str, _Histogram] = {}
        self._clock = clock

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] += amount  # type: ignore[assignment]

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return float(self._counters[(name, tuple(sorted(labels.items())))])

    def describe(self, name: str, help_text: str) -> None:
        self._help[name] = help_text

    def declare_histogram(self, name: str, help_text: str) -> None:
        """A duration histogram (seconds, ``BUCKETS_S``), rendered from the start."""
        with self._lock:
            self._histograms.setdefault(name, _Histogram())
        self._help[name] = help_text

    def observe(self, name: str, seconds: float) -> None:
        """Record one duration in ``name`` (declared on first use)."""
        with self._lock:
            self._histograms.setdefault(name, _Histogram()).observe(seconds)

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Observe how long the block took, whether it succeeded or not."""
        started = self._clock()
        try:
            yield
        finally:
            self.observe(name, self._clock() - started)

    def render(self) -> str:
        """The Prometheus text exposition format (counters only)."""
        lines: list[str] = []
        with self._lock:
            items = sorted(self._counters.items())
        seen: set[str] = set()
        for (name, labels), value in items:
            if name not in seen:
                seen.add(name)
                if name in self._help:
                    lines.append(f"# HELP {name} {self._help[name]}")
                lines.append(f"# TYPE {name} counter")
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            suffix = f"{{{label_text}}}" if label_text else ""
            lines.append(f"{name}{suffix} {value:g}")
        with self._lock:
            histograms = sorted((n, h.snapshot()) for n, h in self._histograms.items())
        for name, (counts, total, count) in histograms:
            if name in self._help:
                lines.append(f"# HELP {name} {self._help[name]}")
            lines.append(f"# TYPE {name} histogram")
            cumulative = 0
            for bound, bucket in zip(BUCKETS_S, counts, strict=False):
                cumulative += bucket
                lines.append(f'{name}_bucket{{le="{bound:g}"}} {cumulative}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {count}')
            lines.append(f"{name}_sum {total:g}")
            lines.append(f"{name}_count {count}")
        return "\n".join(lines) + "\n"


BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds of every duration histogram, in seconds (a turn can take minutes)."""


class _Histogram:
    def __init__(self) -> None:
        self._counts = [0] * (len(BUCKETS_S) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> tuple[list[int], float, int]:
        return list(self._counts[: len(BUCKETS_S)]), self._sum, sum(self._counts)


def render_provider_counters(provider_name: str, counters: object) -> str:
    """Prometheus lines for a provider's own counter dataclass (e.g. MicroVM launches)."""
    if not dataclasses.is_dataclass(counters) or isinstance(counters, type):
        return ""
    lines = []
    label = f'provider="{_escape(provider_name)}"'
    for field in dataclasses.fields(counters):
        value = getattr(counters, field.name)
        if isinstance(value, int | float):
            name = f"sandcell_provider_{field.name}_total"
            lines += [f"# TYPE {name} counter", f"{name}{{{label}}} {value:g}"]
    return "\n".join(lines) + ("\n" if lines else "")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


METRIC_HELP = {
    "sandcell_executions_total": "Executions by final status.",
    "sandcell_launches_total": "Sandbox launches by outcome.",
    "sandcell_restores_total": "Checkpoint restores by outcome.",
    "sandcell_checkpoints_total": "Checkpoints by outcome.",
    "sandcell_checkpoint_bytes_total": "Bytes of checkpoints stored.",
    "sandcell_checkpoint_retries_total": "Failed checkpoints a turn retried.",
    "sandcell_lock_contention_total": "Session lock attempts that found the session busy.",
    "sandcell_fallbacks_total": "Turns run statelessly or recycled, by reason.",
    "sandcell_idle_suspends_total": "Sandboxes suspended by the idle sweeper.",
    "sandcell_checkpoints_collected_total": "Superseded checkpoint objects deleted.",
    "sandcell_remains_removed_total": "Dead sandboxes no record named, removed by the sweeper.",
    "sandcell_interrupted_turns_total": "Session turns interrupted (cancelled, client gone).",
    "sandcell_turns_found_applied_total": (
        "Keyed turns whose retry found them applied in the newest checkpoint, answered "
        "from the result saved with it (the registry had forgotten the session)."
    ),
    "sandcell_egress_allowed_total": "Sandbox connections the egress gateway allowed.",
    "sandcell_egress_refused_total": "Sandbox connections and lookups the egress policy refused.",
    "sandcell_preview_upstream_failures_total": (
        "App preview requests whose sandbox or app did not answer, by kind."
    ),
    "sandcell_e2b_timeout_pause_kills_total": (
        "E2B autoPause sandboxes killed at their timeout because the pause could not be "
        "done, by reason (too_large: the workspace cannot be saved, past "
        "SANDCELL_CHECKPOINT_MAX_BYTES or _MAX_MEMBERS; failed: it kept "
        "failing)."
    ),
}

METRIC_SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sandcell_executions_total": (
        "status",
        ("ok", "error", "timeout", "output_limit", "memory_limit", "disk_limit", "signaled"),
    ),
    "sandcell_launches_total": ("outcome", ("ok", "failed", "timeout")),
    "sandcell_restores_total": ("outcome", ("ok", "missing", "rejected", "failed")),
    "sandcell_checkpoints_total": ("outcome", ("ok", "unchanged", "failed")),
    "sandcell_fallbacks_total": (
        "reason",
        ("no_hint", "recycled", "sandbox_lost", "sandbox_gone"),
    ),
    "sandcell_preview_upstream_failures_total": ("kind", ("http", "websocket")),
    "sandcell_e2b_timeout_pause_kills_total": ("reason", ("too_large", "failed")),
}
"""The label and the values each labelled counter starts with (at 0)."""

HISTOGRAMS = {
    "sandcell_turn_duration_seconds": "Session and stateless turns, start to result.",
    "sandcell_launch_duration_seconds": "Sandbox launches (create + health).",
    "sandcell_restore_duration_seconds": "Checkpoint restores into a new sandbox.",
    "sandcell_checkpoint_duration_seconds": "Checkpoints: export, store and commit.",
}


def declared_metrics(*, clock: Callable[[], float] = time.monotonic) -> Metrics:
    """A ``Metrics`` with every orchestrator series declared at 0."""
    metrics = Metrics(clock=clock)
    for name, help_text in METRIC_HELP.items():
        metrics.describe(name, help_text)
        label, values = METRIC_SERIES.get(name, ("", ()))
        if not values:
            metrics.inc(name, 0)
        for value in values:
            metrics.inc(name, 0, **{label: value})
    for name, help_text in HISTOGRAMS.items():
        metrics.declare_histogram(name, help_text)
    return metrics
