"""``SandboxListing``: a tenant's E2B sandboxes a page at a time, by start time.

E2B's ``GET /v2/sandboxes`` lists newest first (``order=desc``, its default) or
oldest first (``order=asc``), paged by a ``nextToken`` that names where the last page
ended: here the ``(started_at_s, sandbox_id)`` of its last sandbox, ties on the start
time by id, so chained pages give every sandbox once however sandboxes come and go
between them.

The rows come from the registry alone (``e2b_sandboxes_by_start``), which a page
reads a bounded amount of. A paused sandbox's row is also kept in the snapshot store
(``kept.py``), where a registry wipe cannot reach, and the store lists its keys in id
order only: so before a listing that wants paused sandboxes, the tenant's kept rows
are merged into the registry (each one the registry lacks rebuilt, as a lookup by id
would), once per ``MERGE_TTL_S``, which the registry remembers with a mark a wipe
takes with it. Only the first listing after a wipe (or the mark's end) reads the
tenant's kept ids whole; every other reads the registry's page only.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from ..registry import E2bSandboxRow, E2bStartKey, SessionRegistry, validate_e2b_sandbox_id
from .kept import KeptRows
from .sandbox import E2bSandbox
from .views import SandboxViews

__all__ = [
    "MERGE_TTL_S",
    "PAGE_READS",
    "READ_ON_ROWS",
    "ListingOrder",
    "SandboxListing",
    "page_key",
    "page_token",
]

ListingOrder = Literal["asc", "desc"]
"""E2B's ``order``: oldest first, newest first (its default)."""

PAGE_READS = 4
"""How many reads of the registry one listing page makes at most: past that, a page the
filters left short is answered as it is, with a ``nextToken``."""
READ_ON_ROWS = 101
"""How many rows a read after a page's first (``limit + 1``) asks for: a full page's
read at the largest ``limit``, so a sparse filter costs a few requests, not one per row."""
MERGE_TTL_S = 600.0
"""How long a tenant's kept rows count as merged. A pause that wrote its kept row while
a wipe took its registry row (and a merge was reading the store) is listed again by
the next merge, at most this late; a lookup by id finds it at once."""
_MERGE_BATCH = 1000
"""Kept ids read (and checked in the registry) at a time: one S3 listing's worth."""
_TOKEN_CHARS = 200

_Token = tuple[str, float, str]
_TOKEN_DECODER = msgspec.json.Decoder(_Token)


def page_token(key: E2bStartKey, order: ListingOrder) -> str:
    """The ``nextToken`` of a page that ended at ``key`` (opaque: the order, the start
    time as JSON writes it, exactly, and the id, in URL-safe base64)."""
    raw = msgspec.json.encode((order, key[0], key[1]))
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def page_key(token: str, order: ListingOrder) -> E2bStartKey:
    """Where the page after ``token`` starts; ``ValueError`` unless ``token`` is one
    ``page_token`` gave for this ``order`` (a token of one order is not a place in
    the other)."""
    if not token or len(token) > _TOKEN_CHARS or not token.isascii():
        raise ValueError("not a token of this listing")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        given, started_at_s, sandbox_id = _TOKEN_DECODER.decode(raw)
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise ValueError("not a token of this listing") from None
    if given != order or not math.isfinite(started_at_s):
        raise ValueError("not a token of this listing")
    validate_e2b_sandbox_id(sandbox_id)
    return (started_at_s, sandbox_id)


def _key(row: E2bSandboxRow) -> E2bStartKey:
    return (row.started_at_s, row.sandbox_id)


class SandboxListing:
    """Pages of a tenant's sandboxes from the registry, the store's kept rows merged in."""

    def __init__(
        self,
        registry: Callable[[], SessionRegistry],
        *,
        kept: KeptRows,
        views: SandboxViews,
    ) -> None:
        self._registry = registry
        self._kept = kept
        self._views = views

    def __repr__(self) -> str:
        return f"SandboxListing({self._kept!r})"

    async def page(
        self,
        owner: str,
        *,
        after: E2bStartKey | None,
        limit: int,
        order: ListingOrder = "desc",
        states: Sequence[str] = ("running", "paused"),
        started_after: float | None = None,
        picks: Callable[[E2bSandbox], bool] = lambda _sandbox: True,
    ) -> tuple[list[E2bSandbox], E2bStartKey | None]:
        """Up to ``limit`` of ``owner``'s sandboxes in ``states``, started at or after
        ``started_after``, that ``picks`` takes, past ``after`` in ``order``; and where
        the next page starts (``None`` on the last).

        A page reads ``limit + 1`` rows, then reads on (``READ_ON_ROWS`` at a time)
        past those the filters leave out until it is full or the rows end, but for
        ``PAGE_READS`` reads at most: a filter that matches few of many sandboxes gets
        a short (even empty) page with the place it reached, where one request would
        otherwise read the tenant's whole table. ``started_after`` bounds the range
        itself: oldest first it is where the range starts, newest first where it ends."""
        if "paused" in states:
            await self.merge_kept(owner)
        registry = self._registry()
        newest_first = order == "desc"
        start = after
        if start is None and started_after is not None and not newest_first:
            start = (started_after, "")  # '' sorts below every id: the range is >= it
        chosen: list[E2bSandbox] = []
        size = limit + 1
        for read in range(1, PAGE_READS + 1):
            rows = await registry.e2b_sandboxes_by_start(
                owner, after=start, limit=size, newest_first=newest_first
            )
            for row in rows:
                if len(chosen) == limit:
                    return chosen, start
                early = started_after is not None and row.started_at_s < started_after
                if early and newest_first:
                    return chosen, None  # the rest started earlier still
                start = _key(row)
                if early:
                    continue
                sandbox = await self._views.view(row)
                if sandbox.state in states and picks(sandbox):
                    chosen.append(sandbox)
            if len(rows) < size:
                return chosen, None
            if len(chosen) == limit:
                return chosen, start
            if read == PAGE_READS:
                return chosen, start
            # Every row read was looked at and the page is not full yet: read on, in
            # larger reads (the filters are leaving rows out).
            size = max(limit + 1, READ_ON_ROWS)
        raise AssertionError("unreachable: the last read returns")

    async def merge_kept(self, owner: str) -> None:
        """Rebuild each of ``owner``'s kept rows the registry lacks (a wipe's), unless
        the registry's mark says that was done within ``MERGE_TTL_S``."""
        registry = self._registry()
        if await registry.e2b_kept_merged(owner):
            return
        after: str | None = None
        while True:
            ids, bound = await self._kept.page(owner, after=after, limit=_MERGE_BATCH)
            present = await registry.e2b_sandboxes_present(ids)
            for sandbox_id in ids:
                if sandbox_id not in present:
                    await self._kept.rebuild(registry, sandbox_id, owner=owner)
            if bound is None:
                break
            after = bound
        await registry.mark_e2b_kept_merged(owner, ttl_s=MERGE_TTL_S)
