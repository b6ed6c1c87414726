"""How long a session lock lives, derived from the budgets of the work it guards."""

from __future__ import annotations

import math

__all__ = ["lock_ttl_ms"]


def lock_ttl_ms(
    *,
    launch_s: float,
    health_s: float,
    execute_s: float,
    checkpoint_s: float,
    margin: float = 1.5,
) -> int:
    """The lock TTL, in milliseconds, for one turn: launch, health, execute, checkpoint.

    A holder that dies mid-turn blocks its session until the lock expires, and a
    lock that expires mid-turn lets a second worker in. Deriving the TTL from the
    configured budgets (times ``margin`` for scheduling and network slack) keeps
    both bounded when those budgets change; a constant would silently drift.
    """
    budgets = {
        "launch_s": launch_s,
        "health_s": health_s,
        "execute_s": execute_s,
        "checkpoint_s": checkpoint_s,
    }
    for name, value in budgets.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}: must be a finite number >= 0")
    if not math.isfinite(margin) or margin < 1:
        raise ValueError("margin: must be a finite number >= 1")
    total_s = sum(budgets.values())
    if total_s <= 0:
        raise ValueError("budgets: at least one must be > 0")
    return math.ceil(total_s * margin * 1000)
