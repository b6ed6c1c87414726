"""``E2bSandboxes.page`` (``GET /v2/sandboxes``): a page reads one page of the registry's
E2B table and one of the store's kept rows, never the whole of either, and pages chained
by their ``nextToken`` give every sandbox once, in id order, wherever (registry, store,
both) its row is; with the state and metadata filters each page is full but the last.

Every registry backend (Redis the real redis-server), the directory store and moto's
S3; the rows are written directly (no runner is started: a listing reaches none). The
SDK's view of the same paging, over real sandboxes paused and wiped, is in
``test_wiped_redis``.
"""

from __future__ import annotations

import contextlib
import datetime
import random
import secrets
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
from e2b.api.client.types import UNSET
from starlette.applications import Starlette

from sandcell_orchestrator.e2b.control import ControlPlane
from sandcell_orchestrator.e2b.errors import E2bError
from sandcell_orchestrator.e2b.kept import KeptRows
from sandcell_orchestrator.e2b.sandboxes import (
    PAGE_READS,
    READ_ON_ROWS,
    E2bSandbox,
    E2bSandboxes,
)
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import (
    E2bSandboxRow,
    InProcessRegistry,
    RedisRegistry,
    SessionRegistry,
    SqliteRegistry,
)
from sandcell_orchestrator.sessions.manager import SandboxManager, sandbox_session_key
from sandcell_orchestrator.snapshots import DirectorySnapshotStore, S3SnapshotStore, SnapshotStore
from tests.orchestrator.conftest import S3Server, redis_url, s3_server

__all__ = ["redis_url", "s3_server"]

TENANT, OTHER = "tenant-a", "tenant-b"


class _CountingTable:
    """The registry, recording how many rows each of its E2B listings returned.

    ``wipe`` takes rows out as a wipe does: a removal marks the id killed
    (``e2b_sandbox_killed``), a wipe takes the marks with it, so a wiped id is not
    killed here until a real removal (a kill) goes through this table."""

    def __init__(self, inner: SessionRegistry) -> None:
        self._inner = inner
        self.reads: list[int] = []
        self.wiped: set[str] = set()

    async def wipe(self, sandbox_id: str) -> None:
        await self._inner.remove_e2b_sandbox(sandbox_id)
        self.wiped.add(sandbox_id)

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

    async def e2b_sandboxes(self, namespace: str | None = None) -> list[E2bSandboxRow]:
        rows = await self._inner.e2b_sandboxes(namespace)
        self.reads.append(len(rows))
        return rows

    async def e2b_sandboxes_of(self, namespace: str, **page: Any) -> list[E2bSandboxRow]:
        rows: list[E2bSandboxRow] = await self._inner.e2b_sandboxes_of(namespace, **page)
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


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SessionRegistry]:
    registry: SessionRegistry
    if request.param == "memory":
        registry = InProcessRegistry()
    elif request.param == "sqlite":
        registry = SqliteRegistry(tmp_path / "registry.sqlite3")
    else:
        url: str = request.getfixturevalue("redis_url")
        registry = RedisRegistry.from_url(url, prefix=f"e2b-pages-{uuid.uuid4().hex}:")
    yield registry
    if isinstance(registry, RedisRegistry):
        client = registry._client
        keys = [key async for key in client.scan_iter(match=f"{registry.prefix}*")]
        if keys:
            await client.delete(*keys)
    await registry.close()


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
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return E2bSandboxRow(
        sandbox_id="".join(secrets.choice(alphabet) for _ in range(20)),
        namespace=namespace,
        template="base",
        session_id=sandbox_session_key(str(uuid.uuid4())),
        access_token="access-secret",
        traffic_token="traffic-secret",
        metadata=metadata or {},
        env={},
        egress=None,
        started_at_s=1_700_000_000.0 + random.random(),
        end_at_s=1_700_000_600.0,
        auto_pause=False,
        state=state,  # type: ignore[arg-type]
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


async def _every_page(listing: _Listing, *, limit: int, **filters: Any) -> list[list[E2bSandbox]]:
    pages: list[list[E2bSandbox]] = []
    after: str | None = None
    while True:
        page, after = await listing.sandboxes.page(TENANT, after=after, limit=limit, **filters)
        assert all(sandbox.owner == TENANT for sandbox in page)
        assert len(page) <= limit
        pages.append(page)
        if after is None:
            return pages
        assert not page or after >= page[-1].sandbox_id


def _ids(pages: Sequence[Sequence[E2bSandbox]]) -> list[str]:
    return [sandbox.sandbox_id for page in pages for sandbox in page]


@pytest.mark.parametrize("layout", ["registry first", "store first", "interleaved"])
async def test_pages_list_every_sandbox_once_from_the_registry_the_store_or_both(
    listing: _Listing, layout: str
) -> None:
    """30 sandboxes, each in the registry, the store or both (another tenant's between
    them): pages of any size chained by ``nextToken`` give each once, in id order, each
    page full but the last (no empty page at the end), and each read of the registry
    returns at most ``limit + 1`` rows: never the tenant's whole table."""
    placed = await _seed(listing, layout, 30, metadata=lambda _n: {})
    ids = sorted(placed)
    for limit in (1, 2, 3, 7, 29, 30, 31, 100):
        await _wipe_rebuilt(listing, placed)
        listing.table.reads.clear()
        pages = await _every_page(listing, limit=limit)
        assert _ids(pages) == ids, limit
        assert [len(page) for page in pages[:-1]] == [limit] * (len(pages) - 1), limit
        assert len(pages) == -(-len(ids) // limit), limit
        assert listing.table.reads, limit
        assert max(listing.table.reads) <= limit + 1, (limit, listing.table.reads)
        assert len(listing.table.reads) == len(pages), (limit, listing.table.reads)
    for sandbox_id in ids:
        found = await listing.registry.e2b_sandbox(sandbox_id)
        assert found is not None
        assert found.namespace == TENANT


async def test_filtered_pages_are_full_but_the_last_and_skip_nothing(
    dir_listing: _Listing,
) -> None:
    """With the state filter and a metadata query, a page the filters leave short reads
    on (both sources, a page at a time) until it is full or they end: chained pages give
    exactly the sandboxes that match, once, in id order, each full but the last."""
    listing = dir_listing

    def parity(n: int) -> dict[str, str]:
        return {"parity": "even" if n % 2 == 0 else "odd", "n": str(n)}

    placed = await _seed(listing, "interleaved", 40, metadata=parity)
    rows: dict[str, E2bSandboxRow] = {}
    for sandbox_id, where in placed.items():
        row = await listing.registry.e2b_sandbox(sandbox_id)
        if row is None:
            row = await listing.kept.read(TENANT, sandbox_id)
        assert row is not None, where
        rows[sandbox_id] = row
    ids = sorted(rows)
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
    for filters, matches in cases:
        expected = [sandbox_id for sandbox_id in ids if matches(rows[sandbox_id])]
        assert expected, filters
        for limit in (1, 2, 3, 5, 100):
            await _wipe_rebuilt(listing, placed)
            listing.table.reads.clear()
            pages = await _every_page(listing, limit=limit, **filters)
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
    exactly the matches, once, in id order."""
    listing = dir_listing

    def hit(n: int) -> dict[str, str]:
        return {"hit": "yes" if n % 200 == 199 else "no"}

    placed = await _seed(listing, "interleaved", 400, metadata=hit)
    expected = []
    for sandbox_id in sorted(placed):
        row = await listing.registry.e2b_sandbox(sandbox_id) or await listing.kept.read(
            TENANT, sandbox_id
        )
        assert row is not None
        if row.metadata["hit"] == "yes":
            expected.append(sandbox_id)
    assert len(expected) == 2
    for limit in (1, 3):
        await _wipe_rebuilt(listing, placed)
        found: list[str] = []
        after: str | None = None
        requests = 0
        while True:
            listing.table.reads.clear()
            page, after = await listing.sandboxes.page(
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
        assert requests <= 400 // ((PAGE_READS - 1) * READ_ON_ROWS) + 2, (limit, requests)


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
                    page, _ = await one.page(TENANT, after=None, limit=10)
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
        "state=running%2Cgone",
        "startedAfter=yesterday",
        "startedAfter=" + "2" * 100,
    ],
)
async def test_a_malformed_listing_query_is_a_400_before_any_read(query: str) -> None:
    """``limit``, ``nextToken`` and ``state`` come from the caller: one that is not what
    the route takes is E2B's 400 ``bad_request``, answered before the table (the
    registry or the store) is reached."""

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
    """``SandboxQuery(template=, started_after=)`` as e2b's own client puts them in the
    query (``get_v2_sandboxes``): only the tenant's sandboxes of that template, started
    at or after that time, are listed, across pages (a filter the route ignored would
    list, and a caller might kill, the ones it asked to leave out)."""
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
        for query, matches in cases:
            expected = sorted(row.sandbox_id for row in rows if matches(row))
            assert 0 < len(expected) < len(rows), query
            listed: list[str] = []
            token: str | None = None
            while True:
                kwargs = get_v2_sandboxes._get_kwargs(
                    limit=2, next_token=token if token else UNSET, **query
                )
                answer = await client.get(
                    kwargs["url"], params=kwargs["params"], headers={"X-API-KEY": "key"}
                )
                assert answer.status_code == 200, answer.text
                listed += [item["sandboxID"] for item in answer.json()]
                token = answer.headers.get("x-next-token")
                if not token:
                    break
            assert listed == expected, query
