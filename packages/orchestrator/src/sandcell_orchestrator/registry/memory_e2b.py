"""The fleet's E2B sandboxes in this process's memory (``E2bSandboxTable`` of
``InProcessRegistry``): one dict of rows, listings by a pass over them (no index)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio

from .e2b import KILLED_E2B_TTL_S, E2bSandboxRow, E2bStartKey, validate_e2b_sandbox_id
from .index import check_page_limit

__all__ = ["InProcessE2bTable"]


class InProcessE2bTable:
    """``E2bSandboxTable`` in dicts: the rows, killed ids, merged namespaces."""

    def __init__(self) -> None:
        self._e2b: dict[str, E2bSandboxRow] = {}
        self._e2b_killed: dict[str, float] = {}
        """Removed ids, to when (``time.monotonic``) they stop counting as killed, oldest
        first (one TTL for all): the ones that ran out are popped from the front."""
        self._e2b_kept_merged: dict[str, float] = {}

    async def add_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Store a row at its revision; ``False`` if the id is taken."""
        await anyio.lowlevel.checkpoint()
        if row.sandbox_id in self._e2b:
            return False
        self._e2b[row.sandbox_id] = row
        return True

    async def e2b_sandbox(self, sandbox_id: str) -> E2bSandboxRow | None:
        """The row; ``None`` if missing."""
        validate_e2b_sandbox_id(sandbox_id)
        await anyio.lowlevel.checkpoint()
        return self._e2b.get(sandbox_id)

    async def e2b_sandboxes(self) -> list[E2bSandboxRow]:
        """Every row, by start time then id."""
        await anyio.lowlevel.checkpoint()
        return sorted(self._e2b.values(), key=_start_key)

    async def e2b_sandboxes_by_start(
        self,
        namespace: str,
        *,
        after: E2bStartKey | None = None,
        limit: int,
        newest_first: bool = False,
    ) -> list[E2bSandboxRow]:
        """``namespace``'s rows by start time then id (reversed with ``newest_first``),
        the first ``limit`` past ``after`` (a sort of the namespace's rows: in-process)."""
        check_page_limit(limit)
        await anyio.lowlevel.checkpoint()
        rows = sorted(
            (r for r in self._e2b.values() if r.namespace == namespace),
            key=_start_key,
            reverse=newest_first,
        )
        if after is not None:
            rows = [
                r
                for r in rows
                if (_start_key(r) < after if newest_first else _start_key(r) > after)
            ]
        return rows[:limit]

    async def e2b_due(self, now_s: float, *, limit: int) -> list[E2bSandboxRow]:
        """Running rows ended by ``now_s``, soonest first (a pass over the rows: in-process)."""
        check_page_limit(limit)
        await anyio.lowlevel.checkpoint()
        due = (r for r in self._e2b.values() if r.state == "running" and r.end_at_s <= now_s)
        return sorted(due, key=lambda r: (r.end_at_s, r.sandbox_id))[:limit]

    async def e2b_running_of(self, namespace: str) -> list[E2bSandboxRow]:
        """``namespace``'s running rows, by start time then id."""
        await anyio.lowlevel.checkpoint()
        rows = (r for r in self._e2b.values() if r.namespace == namespace and r.state == "running")
        return sorted(rows, key=_start_key)

    async def e2b_running_count(self, namespace: str) -> int:
        """How many of ``namespace``'s rows run (a pass over the rows: in-process)."""
        await anyio.lowlevel.checkpoint()
        rows = self._e2b.values()
        return sum(1 for r in rows if r.namespace == namespace and r.state == "running")

    async def e2b_index(self, rows: Sequence[E2bSandboxRow]) -> None:
        """Nothing to do: the in-process table keeps no index (and no older writer)."""
        await anyio.lowlevel.checkpoint()

    async def e2b_sandboxes_present(self, sandbox_ids: Sequence[str]) -> set[str]:
        """Which of ``sandbox_ids`` have a row."""
        await anyio.lowlevel.checkpoint()
        return {i for i in sandbox_ids if validate_e2b_sandbox_id(i) in self._e2b}

    async def e2b_kept_merged(self, namespace: str) -> bool:
        """Whether ``namespace`` was marked merged within its TTL."""
        await anyio.lowlevel.checkpoint()
        return self._e2b_kept_merged.get(namespace, 0.0) > time.monotonic()

    async def mark_e2b_kept_merged(self, namespace: str, *, ttl_s: float) -> None:
        """Mark ``namespace`` merged for ``ttl_s`` (one entry per tenant that lists)."""
        await anyio.lowlevel.checkpoint()
        self._e2b_kept_merged[namespace] = time.monotonic() + ttl_s

    async def update_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Compare-and-set on ``revision``."""
        await anyio.lowlevel.checkpoint()
        stored = self._e2b.get(row.sandbox_id)
        if stored is None or stored.revision != row.revision - 1:
            return False
        if stored.namespace != row.namespace:
            return False
        self._e2b[row.sandbox_id] = row
        return True

    async def remove_e2b_sandbox(self, sandbox_id: str) -> bool:
        """Delete the row; the id counts as killed for ``KILLED_E2B_TTL_S``."""
        validate_e2b_sandbox_id(sandbox_id)
        await anyio.lowlevel.checkpoint()
        now = time.monotonic()
        killed = self._e2b_killed
        # Not a rebuild of the dict on every kill: that cost each kill a pass over a
        # day's kills, on the event loop.
        while killed and next(iter(killed.values())) <= now:
            del killed[next(iter(killed))]
        killed.pop(sandbox_id, None)  # re-inserted last, in expiry order
        killed[sandbox_id] = now + KILLED_E2B_TTL_S
        return self._e2b.pop(sandbox_id, None) is not None

    async def e2b_sandbox_killed(self, sandbox_id: str) -> bool:
        """Whether the id was removed in the last ``KILLED_E2B_TTL_S``."""
        validate_e2b_sandbox_id(sandbox_id)
        await anyio.lowlevel.checkpoint()
        return self._e2b_killed.get(sandbox_id, 0.0) > time.monotonic()


def _start_key(row: E2bSandboxRow) -> E2bStartKey:
    return (row.started_at_s, row.sandbox_id)
