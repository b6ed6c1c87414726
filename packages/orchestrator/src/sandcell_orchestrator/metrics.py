"""Counters the orchestrator keeps, rendered as Prometheus text by ``sandcell serve``."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter


class Metrics:
    """Monotonic counters with optional labels; thread-safe, no dependencies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        self._help: dict[str, str] = {}

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] += amount  # type: ignore[assignment]

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return float(self._counters[(name, tuple(sorted(labels.items())))])

    def describe(self, name: str, help_text: str) -> None:
        self._help[name] = help_text

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
        return "\n".join(lines) + "\n"


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
    "sandcell_lock_contention_total": "Session lock attempts that found the session busy.",
    "sandcell_fallbacks_total": "Turns run statelessly or recycled, by reason.",
    "sandcell_idle_suspends_total": "Sandboxes suspended by the idle sweeper.",
    "sandcell_checkpoints_collected_total": "Superseded checkpoint objects deleted.",
    "sandcell_egress_allowed_total": "Sandbox connections the egress gateway allowed.",
    "sandcell_egress_refused_total": "Sandbox connections and lookups the egress policy refused.",
}
