"""Resolving refs: cache hits, pulls from a real file server on a miss, and failed pulls."""

from __future__ import annotations

import base64
import logging
import socket
from pathlib import Path

import anyio
import pytest

from sandcell_protocol import FileRef, InputObject, decode
from sandcell_runner.config import RunnerSettings
from sandcell_runner.errors import BadRequestError, InputMissingError, PayloadTooLargeError
from sandcell_runner.inputs.cache import CachedObject, InputCache
from tests.golden import load_golden
from tests.runner.inputs import (
    MAX_OBJECT_BYTES,
    Blob,
    FileServer,
    Served,
    chunks,
    snapshot,
    upload,
)

GOLDEN = load_golden()["input_cache_key"]
REFUSED = load_golden()["input_ref"]["rejected"]
A = Blob("sess-A", "obj-1", b"alpha,beta\n1,2\n")
SECRET_NAME = "reports/q3-acquisition-target.xlsx"


async def test_miss_is_pulled_from_the_file_server(
    pulling_cache: InputCache, file_server: FileServer
) -> None:
    """A miss pulls GET /files/{session}/{object} once and stores it like a push would."""
    vector = GOLDEN[0]
    blob = Blob(vector["storage_session"], vector["object_id"], b"\x00\xffbinary", read_only=True)
    path = file_server.serve(blob.storage_session, blob.object_id, Served(blob.data))

    found = await pulling_cache.resolve(blob.ref(SECRET_NAME))

    assert found == CachedObject(
        key=vector["key"],
        path=pulling_cache.root / vector["key"],
        size=len(blob.data),
        sha256=blob.facts.sha256,
        read_only=True,
    )
    assert found.path.read_bytes() == blob.data
    sidecar = (pulling_cache.root / f"{vector['key']}.json").read_bytes()
    assert decode(sidecar, InputObject) == blob.facts
    assert all(SECRET_NAME not in p.name for p in pulling_cache.root.iterdir())
    assert SECRET_NAME.encode() not in sidecar
    assert pulling_cache.missing([blob.ref()]) == []
    assert await pulling_cache.resolve(blob.ref("again.bin")) == found
    assert file_server.hits == {path: 1}


@pytest.mark.parametrize("value", REFUSED, ids=repr)
async def test_a_ref_the_protocol_refuses_is_never_pulled(
    pulling_cache: InputCache, file_server: FileServer, value: str
) -> None:
    """A refused storage_session or object_id (golden vectors) is a BadRequestError for
    probe and resolve alike, and no request reaches the file server."""
    for ref in (
        FileRef(storage_session=value, object_id="obj-1", name="x"),
        FileRef(storage_session="sess-A", object_id=value, name="x"),
    ):
        with pytest.raises(BadRequestError):
            await pulling_cache.resolve(ref)
        with pytest.raises(BadRequestError):
            pulling_cache.missing([ref])
    assert file_server.hits == {}


async def test_one_object_at_two_names_is_fetched_once(
    pulling_cache: InputCache, file_server: FileServer
) -> None:
    """Concurrent resolves of one object under two names share one fetch and one entry."""
    path = file_server.serve(A.storage_session, A.object_id, Served(A.data, delay_s=0.2))
    results: dict[str, CachedObject] = {}

    async def resolve(name: str) -> None:
        results[name] = await pulling_cache.resolve(A.ref(name))

    async with anyio.create_task_group() as tg:
        tg.start_soon(resolve, "in/a.csv")
        tg.start_soon(resolve, "in/b.csv")

    assert results["in/a.csv"] == results["in/b.csv"]
    assert results["in/a.csv"].path == pulling_cache.root / A.key
    assert file_server.hits == {path: 1}
    assert sorted(p.name for p in pulling_cache.root.iterdir()) == [A.key, f"{A.key}.json"]


async def test_pushed_object_is_resolved_without_a_fetch(
    pulling_cache: InputCache, file_server: FileServer
) -> None:
    """An object already pushed is served from the cache; the file server is not asked."""
    body, content_type = upload(A)
    await pulling_cache.ingest(chunks(body), content_type, max_total_bytes=len(body))

    found = await pulling_cache.resolve(A.ref())

    assert found.path.read_bytes() == A.data
    assert file_server.hits == {}


@pytest.mark.parametrize(
    "served",
    [
        Served(b"no such object", status=404),
        Served(b"boom", status=500),
        Served(A.data, status=302),
        Served(A.data[:5], content_length=len(A.data)),
    ],
    ids=["404", "500", "redirect", "short-body"],
)
async def test_failed_pull_caches_nothing(
    pulling_cache: InputCache, file_server: FileServer, served: Served
) -> None:
    """A non-200 answer or bytes short of Content-Length: InputMissingError, empty cache."""
    file_server.serve(A.storage_session, A.object_id, served)

    with pytest.raises(InputMissingError, match="'sess-A'/'obj-1'"):
        await pulling_cache.resolve(A.ref())

    assert snapshot(pulling_cache.root) == {}


@pytest.mark.parametrize(
    "served",
    [
        Served(b"x" * 64, content_length=MAX_OBJECT_BYTES + 1),
        Served(b"x" * (MAX_OBJECT_BYTES + 1), content_length=-1),
    ],
    ids=["declared", "streamed"],
)
async def test_pull_over_the_object_cap_caches_nothing(
    pulling_cache: InputCache, file_server: FileServer, served: Served
) -> None:
    """An object over max_object_bytes is refused whether or not Content-Length says so."""
    file_server.serve(A.storage_session, A.object_id, served)

    with pytest.raises(PayloadTooLargeError):
        await pulling_cache.resolve(A.ref())

    assert snapshot(pulling_cache.root) == {}


async def test_pull_without_content_length_is_stored(
    pulling_cache: InputCache, file_server: FileServer
) -> None:
    """A close-delimited body (no Content-Length) is stored with its measured size."""
    file_server.serve(A.storage_session, A.object_id, Served(A.data, content_length=-1))

    found = await pulling_cache.resolve(A.ref())

    assert (found.size, found.sha256) == (len(A.data), A.facts.sha256)
    assert pulling_cache.verify(A.key)


async def test_unreachable_file_server_is_input_missing(cache_root: Path) -> None:
    """A connection failure is InputMissingError naming the ref, and nothing is cached."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cache = InputCache(
        cache_root, max_object_bytes=MAX_OBJECT_BYTES, file_server_url=f"http://127.0.0.1:{port}"
    )

    with pytest.raises(InputMissingError, match="pull from the file server failed"):
        await cache.resolve(A.ref())

    assert snapshot(cache_root) == {}


async def test_miss_without_a_file_server_names_the_ref(cache: InputCache) -> None:
    """With no file server a miss is InputMissingError naming session, object and name."""
    with pytest.raises(InputMissingError) as raised:
        await cache.resolve(A.ref(SECRET_NAME))

    message = str(raised.value)
    assert "sess-A" in message
    assert "obj-1" in message
    assert SECRET_NAME in message


async def test_ref_that_cannot_be_keyed_is_a_bad_request(cache: InputCache) -> None:
    """A NUL in an id cannot form a cache key: BadRequestError, for probe and resolve alike."""
    ref = FileRef(storage_session="sess\x00A", object_id="obj-1", name="x")

    with pytest.raises(BadRequestError):
        await cache.resolve(ref)
    with pytest.raises(BadRequestError):
        cache.missing([ref])


async def test_file_server_credentials_go_in_the_header_only(
    cache_root: Path, file_server: FileServer, caplog: pytest.LogCaptureFixture
) -> None:
    """User info in SANDCELL_FILE_SERVER_URL is sent as basic auth, never in the URL that
    httpx logs at INFO (``HTTP Request: GET …``), an error, or a repr of the settings."""
    caplog.set_level(logging.DEBUG)
    secret = "pull-S3CR3T-7c1e"
    url = file_server.url.replace("http://", f"http://puller:{secret}@")
    settings = RunnerSettings.from_env(
        {
            "SANDCELL_RUNNER_INSECURE_NO_AUTH": "1",
            "SANDCELL_WORKSPACE_ROOT": str(cache_root.parent / "ws"),
            "SANDCELL_FILE_SERVER_URL": url,
        }
    )
    assert settings.file_server_url == url
    cache = InputCache(
        cache_root,
        max_object_bytes=MAX_OBJECT_BYTES,
        file_server_url=settings.file_server_url,
        http_timeout_s=5,
    )
    file_server.serve(A.storage_session, A.object_id, Served(A.data))
    assert (await cache.resolve(A.ref())).path.read_bytes() == A.data
    with pytest.raises(InputMissingError, match="HTTP 404") as caught:
        await cache.resolve(Blob("sess-A", "obj-absent", b"").ref())
    basic = "Basic " + base64.b64encode(f"puller:{secret}".encode()).decode()
    assert file_server.authorizations == [basic, basic]
    assert any(r.getMessage().startswith("HTTP Request: GET") for r in caplog.records)
    for text in (caplog.text, str(caught.value), repr(cache), repr(settings)):
        assert secret not in text
