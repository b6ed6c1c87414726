"""``SandboxListing.page`` (``GET /v2/sandboxes``): pages chained by their ``nextToken``
give every sandbox once, newest first (oldest first with ``order=asc``), wherever
(registry, store, both) its row is; with the state and metadata filters each page is
full but the last. A page reads one page of the registry's E2B table, never the whole
of it; the store's kept rows are merged into the registry by the first listing after
a wipe (or once the registry's merge mark ran out), not read by every page.

Every registry backend (Redis the real redis-server), the directory store and moto's
S3; the rows are written directly (no runner is started: a listing reaches none). The
SDK's view of the same paging, over real sandboxes paused and wiped, is in
``test_wiped_redis``.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import random
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from e2b.api.client.api.sandboxes import get_v2_sandboxes
from e2b.api.client.models.order_direction import OrderDirection
from e2b.api.client.types import UNSET
from starlette.applications import Starlette

from sandcell_orchestrator.e2b.control import ControlPlane
from sandcell_orchestrator.e2b.errors import E2bError
from sandcell_orchestrator.e2b.kept import KeptRows
from sandcell_orchestrator.e2b.listing import (
    PAGE_READS,
    READ_ON_ROWS,
    ListingOrder,
    page_token,
)
from sandcell_orchestrator.e2b.sandboxes import E2bSandbox, E2bSandboxes
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import (
    E2bSandboxRow,
    E2bStartKey,
    SessionRegistry,
)
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import DirectorySnapshotStore, S3SnapshotStore, SnapshotStore
from tests.e2b_api.registries import backend, e2b_row, redis_url
from tests.orchestrator.conftest import S3Server, s3_server

__all__ = ["backend", "redis_url", "s3_server"]

TENANT, OTHER = "tenant-a", "tenant-b"


class _CountingTable:
    """The registry, recording how many rows each of its E2B listings returned.

    ``wipe`` takes rows out as a wipe does: a removal marks the id killed
    (``e2b_sandbox_killed``), a wipe takes the marks with it, so a wiped id is not
    killed here until a real removal (a kill) goes through this table; and it takes
    the tenants' merge marks (kept here, not in the backend, so a wipe can)."""

    def __init__(self, inner: SessionRegistry) -> None:
        self._inner = inner
        self.reads: list[int] = []
        self.wiped: set[str] = set()
        self.merged: set[str] = set()

    async def wipe(self, sandbox_id: str) -> None:
        await self._inner.remove_e2b_sandbox(sandbox_id)
        self.wiped.add(sandbox_id)
        self.merged.clear()

    async def e2b_kept_merged(self, namespace: str) -> bool:
        return namespace in self.merged

    async def mark_e2b_kept_merged(self, namespace: str, *, ttl_s: float) -> None:
        assert ttl_s > 0
        self.merged.add(namespace)

    async def remove_e2b_sandbox(self, sandbox_id: str) -> bool:
        self.wiped.discard(sandbox_id)
        removed: bool = await self._inner.remove_e2b_sandbox(sandbox_id)
        return removed

    async def e2b_sandbox_killed(self, sandbox_id: str) -> bool:
        if sandbox_id in self.wiped:
            return False
        killed: bool = await self._inner.e2b_sandbox_killed(sandbox_id)
        return killed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def e2b_sandboxes(self) -> list[E2bSandboxRow]:
        rows = await self._inner.e2b_sandboxes()
        self.reads.append(len(rows))
        return rows

    async def e2b_sandboxes_by_start(self, namespace: str, **page: Any) -> list[E2bSandboxRow]:
        rows: list[E2bSandboxRow] = await self._inner.e2b_sandboxes_by_start(namespace, **page)
        self.reads.append(len(rows))
        return rows


@dataclass
class _Listing:
    sandboxes: E2bSandboxes
    table: _CountingTable
    registry: SessionRegistry

    @property
    def kept(self) -> KeptRows:
        return self.sandboxes.kept

    def count_store_reads(self) -> list[int]:
        """A list that gets one entry per listing of the kept rows from now on."""
        calls: list[int] = []
        real = self.kept.page

        async def page(namespace: str, **kwargs: Any) -> tuple[list[str], str | None]:
            calls.append(1)
            return await real(namespace, **kwargs)

        self.kept.page = page  # type: ignore[method-assign]
        return calls


@contextlib.asynccontextmanager
async def _listing(
    registry: SessionRegistry, store: SnapshotStore, root: Path
) -> AsyncIterator[_Listing]:
    table = _CountingTable(registry)
    provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
    try:
        manager = SandboxManager(provider, table, store)  # type: ignore[arg-type]
        sandboxes = E2bSandboxes(manager, keep_at_exit=True)
        try:
            yield _Listing(sandboxes, table, registry)
        finally:
            await sandboxes.aclose()
            await manager.aclose(destroy_sandboxes=False)
    finally:
        await provider.close()


@pytest.fixture(params=["directory", "s3"])
async def listing(
    request: pytest.FixtureRequest, backend: SessionRegistry, tmp_path: Path
) -> AsyncIterator[_Listing]:
    store: SnapshotStore
    if request.param == "directory":
        store = DirectorySnapshotStore(tmp_path / "snapshots")
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        store = S3SnapshotStore(server.settings(f"e2b-pages-{uuid.uuid4().hex[:8]}"))
    async with store, _listing(backend, store, tmp_path) as made:
        yield made


@pytest.fixture
async def dir_listing(backend: SessionRegistry, tmp_path: Path) -> AsyncIterator[_Listing]:
    async with (
        DirectorySnapshotStore(tmp_path / "snapshots") as store,
        _listing(backend, store, tmp_path) as made,
    ):
        yield made


def _row(namespace: str, *, state: str, metadata: dict[str, str] | None = None) -> E2bSandboxRow:
    return e2b_row(
        namespace,
        state=state,
        started_at_s=1_700_000_000.0 + random.random(),
        end_at_s=1_700_000_600.0,
        metadata=metadata,
    )


# Where a sandbox's row is: the registry only (running, or paused), the registry and
# the store (paused), or the store only (paused, then the registry was wiped).
_PLACES = ("running", "paused", "both", "store")


async def _place(listing: _Listing, row: E2bSandboxRow, where: str) -> None:
    if where in {"running", "paused", "both"}:
        assert await listing.registry.add_e2b_sandbox(row)
    if where in {"both", "store"}:
        await listing.kept.keep(row)


async def _seed(
    listing: _Listing, layout: str, count: int, *, metadata: Callable[[int], dict[str, str]]
) -> dict[str, str]:
    """``count`` of the tenant's sandboxes laid out as ``layout`` says, with another
    tenant's (in every place) between them; each of the tenant's ids -> its place."""
    rng = random.Random(f"{layout}-{count}")
    placed: dict[str, str] = {}
    for n in range(count):
        if layout == "registry first":
            where = _PLACES[n % 2] if n < count // 2 else "store"
        elif layout == "store first":
            where = "store" if n < count // 2 else _PLACES[n % 3]
        else:
            where = rng.choice(_PLACES)
        state = "running" if where == "running" else "paused"
        row = _row(TENANT, state=state, metadata=metadata(n))
        await _place(listing, row, where)
        placed[row.sandbox_id] = where
    for n in range(12):
        where = _PLACES[n % 4]
        await _place(listing, _row(OTHER, state="running" if n % 4 == 0 else "paused"), where)
    return placed


async def _wipe_rebuilt(listing: _Listing, placed: dict[str, str]) -> None:
    """Take the store-only sandboxes out of the registry again (a listing rebuilt them)."""
    for sandbox_id, where in placed.items():
        if where == "store":
            await listing.table.wipe(sandbox_id)


def _key(row: E2bSandboxRow) -> E2bStartKey:
    return (row.started_at_s, row.sandbox_id)


async def _rows_of(listing: _Listing, ids: Sequence[str]) -> dict[str, E2bSandboxRow]:
    """Each id's row, from the registry or (store only) its kept row."""
    rows: dict[str, E2bSandboxRow] = {}
    for sandbox_id in ids:
        row = await listing.registry.e2b_sandbox(sandbox_id)
        if row is None:
            row = await listing.kept.read(TENANT, sandbox_id)
        assert row is not None, sandbox_id
        rows[sandbox_id] = row
    return rows


def _in_order(rows: dict[str, E2bSandboxRow], order: ListingOrder) -> list[str]:
    """The ids as the listing gives them: by start time then id, newest first for desc."""
    ordered = sorted(rows.values(), key=_key, reverse=order == "desc")
    return [row.sandbox_id for row in ordered]


async def _every_page(
    listing: _Listing, *, limit: int, order: ListingOrder = "desc", **filters: Any
) -> list[list[E2bSandbox]]:
    pages: list[list[E2bSandbox]] = []
    after: E2bStartKey | None = None
    while True:
        page, after = await listing.sandboxes.listing.page(
            TENANT, after=after, limit=limit, order=order, **filters
        )
        assert all(sandbox.owner == TENANT for sandbox in page)
        assert len(page) <= limit
        pages.append(page)
        if after is None:
            return pages
        if page:
            last = _key(page[-1].row)
            assert (after <= last) if order == "desc" else (after >= last)


def _ids(pages: Sequence[Sequence[E2bSandbox]]) -> list[str]:
    return [sandbox.sandbox_id for page in pages for sandbox in page]


@pytest.mark.parametrize("layout", ["registry first", "store first", "interleaved"])
async def test_pages_list_every_sandbox_once_from_the_registry_the_store_or_both(
    listing: _Listing, layout: str
) -> None:
    """30 sandboxes, each in the registry, the store or both (another tenant's between
    them): pages of any size chained by ``nextToken`` give each once, newest first or
    oldest first, each page full but the last (no empty page at the end), and each
    read of the registry returns at most ``limit + 1`` rows: never the tenant's whole
    table. The store's kept rows are listed by the first page only (the merge)."""
    placed = await _seed(listing, layout, 30, metadata=lambda _n: {})
    rows = await _rows_of(listing, list(placed))
    store_reads = listing.count_store_reads()
    for limit in (1, 2, 3, 7, 29, 30, 31, 100):
        for order in ("desc", "asc"):
            await _wipe_rebuilt(listing, placed)
            listing.table.reads.clear()
            store_reads.clear()
            pages = await _every_page(listing, limit=limit, order=order)
            assert _ids(pages) == _in_order(rows, order), (limit, order)
            assert [len(page) for page in pages[:-1]] == [limit] * (len(pages) - 1), limit
            assert len(pages) == -(-len(rows) // limit), limit
            assert listing.table.reads, limit
            assert max(listing.table.reads) <= limit + 1, (limit, listing.table.reads)
            assert len(listing.table.reads) == len(pages), (limit, listing.table.reads)
            assert len(store_reads) == 1, (limit, order)
    for sandbox_id in placed:
        found = await listing.registry.e2b_sandbox(sandbox_id)
        assert found is not None
        assert found.namespace == TENANT


async def test_filtered_pages_are_full_but_the_last_and_skip_nothing(
    dir_listing: _Listing,
) -> None:
    """With the state filter and a metadata query, a page the filters leave short reads
    on (a page at a time) until it is full or the rows end: chained pages give exactly
    the sandboxes that match, once, in the order asked for, each full but the last."""
    listing = dir_listing

    def parity(n: int) -> dict[str, str]:
        return {"parity": "even" if n % 2 == 0 else "odd", "n": str(n)}

    placed = await _seed(listing, "interleaved", 40, metadata=parity)
    rows = await _rows_of(listing, list(placed))
    cases: list[tuple[dict[str, Any], Callable[[E2bSandboxRow], bool]]] = [
        ({"states": ("running",)}, lambda row: row.state == "running"),
        ({"states": ("paused",)}, lambda row: row.state == "paused"),
        (
            {"picks": lambda sandbox: sandbox.metadata.get("parity") == "odd"},
            lambda row: row.metadata["parity"] == "odd",
        ),
        (
            {
                "states": ("paused",),
                "picks": lambda sandbox: int(sandbox.metadata["n"]) % 5 == 0,
            },
            lambda row: row.state == "paused" and int(row.metadata["n"]) % 5 == 0,
        ),
    ]
    for (filters, matches), order in itertools.product(cases, ("desc", "asc")):
        expected = [i for i in _in_order(rows, order) if matches(rows[i])]
        assert expected, filters
        for limit in (1, 2, 3, 5, 100):
            await _wipe_rebuilt(listing, placed)
            listing.table.reads.clear()
            pages = await _every_page(listing, limit=limit, order=order, **filters)
            assert _ids(pages) == expected, (filters, limit)
            # Full but the last, which may be empty only where the filters left out
            # what the page before it would have ended on.
            assert all(len(page) == limit for page in pages[:-1]), (filters, limit)
            # A page's first read is ``limit + 1`` rows; a read-on, at most READ_ON_ROWS.
            assert listing.table.reads[0] <= limit + 1, (filters, limit)
            assert max(listing.table.reads) <= max(limit + 1, READ_ON_ROWS), (filters, limit)


async def test_a_sparse_filter_reads_a_bounded_amount_per_page(dir_listing: _Listing) -> None:
    """A filter that matches 2 of 400 sandboxes: one request reads the registry at most
    ``PAGE_READS`` times (the first read ``limit + 1`` rows, a read-on at most
    ``READ_ON_ROWS``), however far apart the matches are; a page that runs out of reads
    comes back short (even empty) with a ``nextToken``, and the chained pages still give
    exactly the matches, once, newest first."""
    listing = dir_listing

    def hit(n: int) -> dict[str, str]:
        return {"hit": "yes" if n % 200 == 199 else "no"}

    placed = await _seed(listing, "interleaved", 400, metadata=hit)
    rows = await _rows_of(listing, list(placed))
    expected = [i for i in _in_order(rows, "desc") if rows[i].metadata["hit"] == "yes"]
    assert len(expected) == 2
    for limit in (1, 3):
        await _wipe_rebuilt(listing, placed)
        found: list[str] = []
        after: E2bStartKey | None = None
        requests = 0
        while True:
            listing.table.reads.clear()
            page, after = await listing.sandboxes.listing.page(
                TENANT, after=after, limit=limit, picks=lambda s: s.metadata["hit"] == "yes"
            )
            requests += 1
            assert len(listing.table.reads) <= PAGE_READS, (limit, listing.table.reads)
            assert listing.table.reads[0] <= limit + 1, (limit, listing.table.reads)
            assert max(listing.table.reads) <= max(limit + 1, READ_ON_ROWS), limit
            found += [sandbox.sandbox_id for sandbox in page]
            if after is None:
                break
        assert found == expected, limit
        # The read-ons are large: a few requests cover the 400, not one per row or two.
        # A request ends at a match (2 here, anywhere in start order: the start times
        # are random) or after its reads, which take over (PAGE_READS - 1) * READ_ON_ROWS
        # rows past the first (all but the last request's).
        assert requests <= len(expected) + -(-400 // ((PAGE_READS - 1) * READ_ON_ROWS)), (
            limit,
            requests,
        )


class _HeldAdds(_CountingTable):
    """The registry, holding each ``add_e2b_sandbox`` until ``release`` is set (once
    ``reached`` is): a rebuild that read the kept row, about to add the row again."""

    def __init__(self, inner: SessionRegistry) -> None:
        super().__init__(inner)
        self.reached = anyio.Event()
        self.release = anyio.Event()

    async def add_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        self.reached.set()
        await self.release.wait()
        added: bool = await self._inner.add_e2b_sandbox(row)
        return added


@pytest.mark.parametrize("path", ["listing", "lookup"])
async def test_a_kill_while_a_wiped_row_is_rebuilt_is_not_undone(
    backend: SessionRegistry, tmp_path: Path, path: str
) -> None:
    """After a wipe, worker one's listing (or lookup) reads a paused sandbox's kept row;
    before it adds the row again, worker two rebuilds it, kills it (kept row, row and
    checkpoints gone) and answers the kill. Worker one's add then lands on an empty id:
    it must not bring the killed sandbox back (listed paused, its checkpoints gone, so
    connect answers 500 until someone kills it again)."""
    row = _row(TENANT, state="paused")
    async with DirectorySnapshotStore(tmp_path / "snapshots") as store:
        await KeptRows(store).keep(row)  # paused, then the registry was wiped
        held = _HeldAdds(backend)
        provider = LocalProvider(LocalSettings(runtime_dir=tmp_path / "rt"))
        one = E2bSandboxes(SandboxManager(provider, held, store), keep_at_exit=True)  # type: ignore[arg-type]
        async with _listing(backend, store, tmp_path / "two") as two:
            found: list[object] = []

            async def worker_one() -> None:
                if path == "listing":
                    page, _ = await one.listing.page(TENANT, after=None, limit=10)
                    found.extend(page)
                else:
                    with contextlib.suppress(E2bError):
                        found.append(await one.get(row.sandbox_id, owner=TENANT))

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(worker_one)
                await held.reached.wait()
                doomed = await two.sandboxes.get(row.sandbox_id, owner=TENANT)
                await two.sandboxes.kill(doomed)
                assert await backend.e2b_sandbox(row.sandbox_id) is None
                held.release.set()
        await one.aclose()
        await provider.close()
        assert found == []
        assert await backend.e2b_sandbox(row.sandbox_id) is None
        assert await KeptRows(store).read(TENANT, row.sandbox_id) is None


async def test_a_tenants_listing_reads_only_its_own_rows(dir_listing: _Listing) -> None:
    """Another tenant's sandboxes (in the registry and the store alike) are in no page
    of this tenant's, and nothing of theirs is rebuilt into the registry by it."""
    listing = dir_listing
    mine = _row(TENANT, state="running")
    await _place(listing, mine, "running")
    theirs = [_row(OTHER, state="paused") for _ in range(5)]
    for row in theirs:
        await _place(listing, row, "store")
    listing.table.reads.clear()
    pages = await _every_page(listing, limit=2)
    assert _ids(pages) == [mine.sandbox_id]
    assert listing.table.reads == [1]
    for row in theirs:
        assert await listing.registry.e2b_sandbox(row.sandbox_id) is None


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=101",
        "limit=-1",
        "limit=two",
        "limit=%C2%B2",  # '²': str.isdigit() takes it, int() does not
        "limit=%D9%A3",  # '٣': an Arabic-Indic digit, which int() reads as 3
        "limit=" + "1" * 5000,  # past int()'s 4300 digits
        "nextToken=..%2Fx",
        "nextToken=" + "a" * 21,
        "nextToken=" + "a" * 20,  # a bare id: the tokens of the listing in id order
        "nextToken=" + page_token((1.7e9, "a" * 20), "asc"),  # of the other order
        "order=asc&nextToken=" + page_token((1.7e9, "a" * 20), "desc"),
        "nextToken=" + page_token((1.7e9, "../../x"), "desc"),
        "nextToken=" + page_token((float("inf"), "a" * 20), "desc"),
        "nextToken=" + "A" * 5000,
        "order=sideways",
        "order=DESC",
        "state=running%2Cgone",
        "startedAfter=yesterday",
        "startedAfter=" + "2" * 100,
    ],
)
async def test_a_malformed_listing_query_is_a_400_before_any_read(query: str) -> None:
    """``limit``, ``nextToken``, ``order`` and ``state`` come from the caller: one that
    is not what the route takes (a token of another order among them) is E2B's 400
    ``bad_request``, answered before the table (the registry or the store) is reached."""

    def table() -> E2bSandboxes:
        raise AssertionError("the listing reached the table")

    plane = ControlPlane(table, namespace_of_key=lambda _key: TENANT, domain=None)
    app = Starlette(routes=plane.routes())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://e2b.test") as client:
        answer = await client.get(f"/e2b/v2/sandboxes?{query}", headers={"X-API-KEY": "key"})
    assert answer.status_code == 400, (query[:40], answer.text)
    assert answer.json()["error_code"] == "bad_request"


async def test_the_sdks_template_and_started_after_filters_are_honoured(
    dir_listing: _Listing,
) -> None:
    """``SandboxQuery(template=, started_after=)`` and ``order`` as e2b's own client puts
    them in the query (``get_v2_sandboxes``): only the tenant's sandboxes of that
    template, started at or after that time, are listed, across pages, newest first
    unless ``order`` is ``asc`` (a filter the route ignored would list, and a caller
    might kill, the ones it asked to leave out)."""
    listing = dir_listing
    rows: list[E2bSandboxRow] = []
    for n in range(12):
        row = _row(TENANT, state="running" if n % 3 else "paused")
        row = msgspec.structs.replace(
            row,
            template="code-interpreter-v1" if n % 2 else "base",
            started_at_s=1_700_000_000.0 + 100 * n,
        )
        await _place(listing, row, "both" if row.state == "paused" else "running")
        rows.append(row)
    await _place(listing, msgspec.structs.replace(_row(OTHER, state="running")), "running")
    cutoff = datetime.datetime.fromtimestamp(1_700_000_000.0 + 550, tz=datetime.UTC)
    plane = ControlPlane(
        lambda: listing.sandboxes, namespace_of_key=lambda _key: TENANT, domain=None
    )
    app = Starlette(routes=plane.routes("/e2b"))
    cases: list[tuple[dict[str, Any], Callable[[E2bSandboxRow], bool]]] = [
        ({"template": "base"}, lambda row: row.template == "base"),
        ({"started_after": cutoff}, lambda row: row.started_at_s >= cutoff.timestamp()),
        (
            {"template": "code-interpreter-v1", "started_after": cutoff.astimezone()},
            lambda row: (
                row.template == "code-interpreter-v1" and row.started_at_s >= cutoff.timestamp()
            ),
        ),
    ]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://e2b.test/e2b") as client:
        for (query, matches), order in itertools.product(cases, (None, "asc", "desc")):
            by_start = sorted(rows, key=_key, reverse=order != "asc")
            expected = [row.sandbox_id for row in by_start if matches(row)]
            assert 0 < len(expected) < len(rows), query
            listed: list[str] = []
            token: str | None = None
            while True:
                kwargs = get_v2_sandboxes._get_kwargs(
                    limit=2,
                    next_token=token if token else UNSET,
                    order=OrderDirection(order) if order else UNSET,
                    **query,
                )
                answer = await client.get(
                    kwargs["url"], params=kwargs["params"], headers={"X-API-KEY": "key"}
                )
                assert answer.status_code == 200, answer.text
                listed += [item["sandboxID"] for item in answer.json()]
                token = answer.headers.get("x-next-token")
                if not token:
                    break
            assert listed == expected, (query, order)


async def test_the_kept_rows_are_merged_once_until_the_mark_runs_out(
    listing: _Listing,
) -> None:
    """The first listing after a wipe lists the tenant's kept rows (and rebuilds the
    ones the registry lacks); the listings after it read the registry only, until the
    registry's merge mark is gone (a wipe, or its TTL: ``MERGE_TTL_S``). A listing of
    running sandboxes only never reads the store."""
    placed = await _seed(listing, "interleaved", 12, metadata=lambda _n: {})
    rows = await _rows_of(listing, list(placed))
    store_reads = listing.count_store_reads()
    running = [i for i in _in_order(rows, "desc") if rows[i].state == "running"]
    assert _ids(await _every_page(listing, limit=5, states=("running",))) == running
    assert store_reads == []
    for _ in range(3):
        assert _ids(await _every_page(listing, limit=5)) == _in_order(rows, "desc")
    assert len(store_reads) == 1
    assert None not in [await listing.registry.e2b_sandbox(i) for i in placed]
    # A wipe since: the next listing merges again, and lists them all again.
    await _wipe_rebuilt(listing, placed)
    assert _ids(await _every_page(listing, limit=100, order="asc")) == _in_order(rows, "asc")
    assert len(store_reads) == 2


async def test_the_merge_mark_is_the_registrys_with_its_ttl(
    backend: SessionRegistry, tmp_path: Path
) -> None:
    """On each real backend (no counting table): a listing leaves the tenant marked
    merged, for ``MERGE_TTL_S``; a sandbox kept in the store only while the mark
    holds is not listed until the mark runs out, then it is (rebuilt). (The mark's
    own length, ``MERGE_TTL_S``, is not waited for here.)"""
    first, late = _row(TENANT, state="paused"), _row(TENANT, state="paused")
    async with DirectorySnapshotStore(tmp_path / "snapshots") as store:
        await KeptRows(store).keep(first)
        provider = LocalProvider(LocalSettings(runtime_dir=tmp_path / "rt"))
        manager = SandboxManager(provider, backend, store)
        sandboxes = E2bSandboxes(manager, keep_at_exit=True)
        try:
            page, _ = await sandboxes.listing.page(TENANT, after=None, limit=10)
            assert [s.sandbox_id for s in page] == [first.sandbox_id]
            assert await backend.e2b_kept_merged(TENANT)
            assert not await backend.e2b_kept_merged(OTHER)
            await KeptRows(store).keep(late)
            page, _ = await sandboxes.listing.page(TENANT, after=None, limit=10)
            assert [s.sandbox_id for s in page] == [first.sandbox_id]
            await backend.mark_e2b_kept_merged(TENANT, ttl_s=0.01)
            await anyio.sleep(0.05)
            page, _ = await sandboxes.listing.page(TENANT, after=None, limit=10)
            newest_first = sorted([first, late], key=_key, reverse=True)
            assert [s.sandbox_id for s in page] == [row.sandbox_id for row in newest_first]
        finally:
            await sandboxes.aclose()
            await manager.aclose(destroy_sandboxes=False)
            await provider.close()
