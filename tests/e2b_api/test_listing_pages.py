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
import random
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandcell_orchestrator.e2b.kept import KeptRows
from sandcell_orchestrator.e2b.sandboxes import E2bSandbox, E2bSandboxes
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
    """The registry, recording how many rows each of its E2B listings returned."""

    def __init__(self, inner: SessionRegistry) -> None:
        self._inner = inner
        self.reads: list[int] = []

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
            await listing.registry.remove_e2b_sandbox(sandbox_id)


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
            assert max(listing.table.reads) <= limit + 1, (filters, limit)


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
