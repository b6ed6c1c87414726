"""Deleting objects nothing points at any more, best effort.

Collection (superseded checkpoints and their turn results, saved stateless answers)
runs on every worker's sweep and again on the next: an object a failed delete left
is only late, never lost track of, so a store error is logged and skipped rather
than failing the sweep.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointError
from .base import SnapshotStore

__all__ = ["collect_key"]

log = logging.getLogger(__name__)


async def collect_key(store: SnapshotStore, key: str, *, before: str | None = None) -> bool:
    """Delete ``before`` (if any), then ``key``; False if the store failed (logged with
    the error's type only: the object is kept for the next round)."""
    try:
        if before is not None:
            await store.delete(before)
        await store.delete(key)
    except CheckpointError as exc:
        log.info("collecting %s failed (%s); kept for now", key, type(exc).__name__)
        return False
    return True
