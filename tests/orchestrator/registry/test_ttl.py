"""lock_ttl_ms: the lock TTL follows the configured budgets."""

from __future__ import annotations

import math

import pytest

from sandcell_orchestrator.registry import lock_ttl_ms


def test_ttl_is_the_budget_sum_with_margin() -> None:
    """(launch + health + execute + checkpoint) x margin, in ms, rounded up."""
    assert lock_ttl_ms(launch_s=10, health_s=5, execute_s=30, checkpoint_s=15) == 90_000
    assert lock_ttl_ms(launch_s=1, health_s=0, execute_s=0, checkpoint_s=0, margin=1) == 1_000
    assert lock_ttl_ms(launch_s=0.0001, health_s=0, execute_s=0, checkpoint_s=0) == 1


def test_ttl_grows_with_every_budget() -> None:
    """Raising any one budget raises the TTL: none is ignored."""
    base = {"launch_s": 10.0, "health_s": 5.0, "execute_s": 30.0, "checkpoint_s": 15.0}
    for name in base:
        assert lock_ttl_ms(**{**base, name: base[name] + 1}) > lock_ttl_ms(**base)


@pytest.mark.parametrize(
    "changes",
    [
        {"launch_s": -1.0},
        {"execute_s": math.inf},
        {"health_s": math.nan},
        {"margin": 0.5},
        {"launch_s": 0.0, "health_s": 0.0, "execute_s": 0.0, "checkpoint_s": 0.0},
    ],
)
def test_nonsense_budgets_are_refused(changes: dict[str, float]) -> None:
    """Negative, infinite or all-zero budgets and a margin below 1 are errors."""
    budgets = {"launch_s": 10.0, "health_s": 5.0, "execute_s": 30.0, "checkpoint_s": 15.0}
    with pytest.raises(ValueError, match="must be"):
        lock_ttl_ms(**{**budgets, **changes})
