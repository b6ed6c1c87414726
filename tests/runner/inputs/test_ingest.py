"""Pushed inputs: probe, ingest, and every way an upload is rejected without a trace."""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest

from sandcell_protocol import InputObject, decode, encode
from sandcell_runner.errors import BadRequestError, PayloadTooLargeError
from sandcell_runner.inputs.cache import InputCache
from tests.golden import load_golden
from tests.runner.inputs import (
    MAX_OBJECT_BYTES,
    Blob,
    chunks,
    manifest_json,
    manifest_part,
    multipart,
    object_part,
    snapshot,
    upload,
)

GOLDEN = load_golden()["input_cache_key"]
A = Blob("sess-A", "obj-1", b"alpha,beta\n1,2\n")
B = Blob("sess-A", "obj-2", bytes(range(256)) * 8, read_only=True)
C = Blob("sess-B", "obj-1", b"")
SECRET_NAME = "reports/q3-acquisition-target.xlsx"


async def test_entries_are_named_by_the_golden_cache_key(cache: InputCache) -> None:
    """The file holding ("sess-A", "obj-1") is named by the shared golden vector."""
    vector = GOLDEN[0]
    assert (vector["storage_session"], vector["object_id"]) == (A.storage_session, A.object_id)
    body, content_type = upload(A)

    stored = await cache.ingest(chunks(body), content_type, max_total_bytes=len(body))

    assert stored == [vector["key"]]
    assert (cache.root / vector["key"]).read_bytes() == A.data
    assert vector["key"].startswith("5fb3a8c0")


async def test_probe_reports_only_missing_refs_in_order(cache: InputCache) -> None:
    """missing() returns absent refs in order, once per ref even for a shared object."""
    body, content_type = upload(A)
    await cache.ingest(chunks(body), content_type, max_total_bytes=len(body))
    refs = [B.ref("one.bin"), A.ref("a.csv"), C.ref("empty"), B.ref("two.bin"), A.ref("b.csv")]

    assert cache.missing(refs) == [B.ref("one.bin"), C.ref("empty"), B.ref("two.bin")]
    assert cache.missing([]) == []


@pytest.mark.parametrize("chunk_size", [1, 7, 64 * 1024])
async def test_good_upload_is_stored_with_object_facts_only(
    cache: InputCache, chunk_size: int
) -> None:
    """Objects land with size/sha256/read_only sidecars; no file name reaches the cache."""
    body, content_type = upload(A, B, C)

    stored = await cache.ingest(chunks(body, chunk_size), content_type, max_total_bytes=len(body))

    assert stored == [A.key, B.key, C.key]
    assert cache.missing([A.ref(SECRET_NAME), B.ref(SECRET_NAME), C.ref(SECRET_NAME)]) == []
    names = sorted(path.name for path in cache.root.iterdir())
    assert names == sorted([A.key, A.key + ".json", B.key, B.key + ".json", C.key, C.key + ".json"])
    for blob in (A, B, C):
        assert (cache.root / blob.key).read_bytes() == blob.data
        sidecar = (cache.root / f"{blob.key}.json").read_bytes()
        assert decode(sidecar, InputObject) == blob.facts
        assert SECRET_NAME.encode() not in sidecar
        assert cache.verify(blob.key)
    assert all(SECRET_NAME not in name for name in names)
    resolved = await cache.resolve(B.ref(SECRET_NAME))
    assert (resolved.key, resolved.path, resolved.size) == (B.key, cache.root / B.key, len(B.data))
    assert (resolved.sha256, resolved.read_only) == (B.facts.sha256, True)


async def test_cache_directory_is_private(cache: InputCache) -> None:
    """The cache directory is 0700 and owned by the runner's user."""
    info = cache.root.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.geteuid()


async def test_large_object_streams_through(cache_root: Path) -> None:
    """A multi-megabyte object is stored intact from 64 KiB chunks."""
    big = Blob("sess-A", "big", os.urandom(3 * 1024 * 1024 + 17))
    cache = InputCache(cache_root, max_object_bytes=4 * 1024 * 1024)
    body, content_type = upload(big)

    await cache.ingest(chunks(body), content_type, max_total_bytes=len(body))

    assert cache.verify(big.key)
    assert (cache_root / big.key).read_bytes() == big.data


async def test_reupload_of_a_present_object_is_idempotent(cache: InputCache) -> None:
    """Pushing an object that is already present keeps the stored entry as it was."""
    body, content_type = upload(A)
    await cache.ingest(chunks(body), content_type, max_total_bytes=len(body))
    before = snapshot(cache.root)
    inode = (cache.root / A.key).stat().st_ino

    assert await cache.ingest(chunks(body), content_type, max_total_bytes=len(body)) == [A.key]

    assert snapshot(cache.root) == before
    assert (cache.root / A.key).stat().st_ino == inode


async def test_concurrent_uploads_of_one_object_do_not_collide(cache: InputCache) -> None:
    """Two uploads of the same key at once both succeed and leave one consistent entry."""
    body, content_type = upload(A, B)

    ingest = functools.partial(cache.ingest, max_total_bytes=len(body))
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(ingest, chunks(body, 5), content_type)

    assert sorted(p.name for p in cache.root.iterdir()) == sorted(
        [A.key, A.key + ".json", B.key, B.key + ".json"]
    )
    assert cache.verify(A.key)
    assert cache.verify(B.key)


Case = Callable[[], tuple[bytes, str]]
EVIL = "../evil"


def _size_longer() -> tuple[bytes, str]:
    return multipart([manifest_part(manifest_json(A, B)), object_part(A.key, A.data + b"x")])


def _size_shorter() -> tuple[bytes, str]:
    parts = [manifest_part(manifest_json(A, B)), object_part(A.key, A.data)]
    return multipart([*parts, object_part(B.key, B.data[:-1])])


def _sha_mismatch() -> tuple[bytes, str]:
    tampered = bytes([B.data[0] ^ 1]) + B.data[1:]
    parts = [manifest_part(manifest_json(A, B)), object_part(A.key, A.data)]
    return multipart([*parts, object_part(B.key, tampered)])


def _unknown_key() -> tuple[bytes, str]:
    parts = [manifest_part(manifest_json(A)), object_part(A.key, A.data)]
    return multipart([*parts, object_part(B.key, B.data)])


def _bad_filename() -> tuple[bytes, str]:
    return multipart([manifest_part(manifest_json(A)), object_part(EVIL, A.data)])


def _missing_manifest() -> tuple[bytes, str]:
    return multipart([object_part(A.key, A.data)])


def _no_parts() -> tuple[bytes, str]:
    _, content_type = upload(A)
    boundary = content_type.split("boundary=")[1].encode()
    return b"--" + boundary + b"--\r\n", content_type


def _manifest_after_file() -> tuple[bytes, str]:
    return multipart([object_part(A.key, A.data), manifest_part(manifest_json(A))])


def _duplicate_part() -> tuple[bytes, str]:
    parts = [manifest_part(manifest_json(A)), object_part(A.key, A.data)]
    return multipart([*parts, object_part(A.key, A.data)])


def _duplicate_manifest() -> tuple[bytes, str]:
    parts = [manifest_part(manifest_json(A)), object_part(A.key, A.data)]
    return multipart([*parts, manifest_part(manifest_json(A))])


def _object_without_part() -> tuple[bytes, str]:
    return multipart([manifest_part(manifest_json(A, B)), object_part(A.key, A.data)])


def _truncated() -> tuple[bytes, str]:
    body, content_type = upload(A, B)
    return body[: len(body) - 40], content_type


def _garbage() -> tuple[bytes, str]:
    _, content_type = upload(A)
    return b"this is not multipart at all\r\n", content_type


def _not_multipart() -> tuple[bytes, str]:
    body, _ = upload(A)
    return body, "application/json"


def _bad_manifest_json() -> tuple[bytes, str]:
    return multipart([manifest_part(b'{"objects": {}, "extra": 1}'), object_part(A.key, A.data)])


def _manifest_key_not_a_key() -> tuple[bytes, str]:
    raw = encode({"objects": {EVIL: A.facts}})
    return multipart([manifest_part(raw), object_part(A.key, A.data)])


def _stray_field() -> tuple[bytes, str]:
    parts = [manifest_part(manifest_json(A)), object_part(A.key, A.data)]
    return multipart([*parts, ("note", (None, b"hello", "text/plain"))])


REJECTIONS: dict[str, tuple[Case, str]] = {
    "size-longer": (_size_longer, A.key),
    "size-shorter": (_size_shorter, B.key),
    "sha-mismatch": (_sha_mismatch, B.key),
    "unknown-key": (_unknown_key, B.key),
    "bad-filename": (_bad_filename, EVIL),
    "missing-manifest": (_missing_manifest, "manifest"),
    "no-parts": (_no_parts, "no manifest"),
    "manifest-after-file": (_manifest_after_file, "manifest"),
    "duplicate-part": (_duplicate_part, A.key),
    "duplicate-manifest": (_duplicate_manifest, "manifest"),
    "object-without-part": (_object_without_part, B.key),
    "truncated": (_truncated, "truncated"),
    "garbage": (_garbage, "multipart"),
    "not-multipart": (_not_multipart, "multipart/form-data"),
    "bad-manifest-json": (_bad_manifest_json, "manifest"),
    "manifest-key-not-a-key": (_manifest_key_not_a_key, "manifest"),
    "stray-field": (_stray_field, "note"),
}


@pytest.mark.parametrize("chunk_size", [3, 64 * 1024])
@pytest.mark.parametrize("case", list(REJECTIONS), ids=list(REJECTIONS))
async def test_bad_upload_is_rejected_and_leaves_the_cache_as_it_was(
    cache: InputCache, case: str, chunk_size: int
) -> None:
    """A bad upload raises BadRequestError naming the culprit; the cache is byte-identical."""
    seed_body, seed_type = upload(C)
    await cache.ingest(chunks(seed_body), seed_type, max_total_bytes=len(seed_body))
    before = snapshot(cache.root)
    build, culprit = REJECTIONS[case]
    body, content_type = build()

    with pytest.raises(BadRequestError) as raised:
        await cache.ingest(chunks(body, chunk_size), content_type, max_total_bytes=1 << 30)

    assert culprit in str(raised.value)
    assert snapshot(cache.root) == before
    assert not (cache.root.parent / "evil").exists()


@pytest.mark.parametrize(
    ("max_object_bytes", "slack"),
    [(MAX_OBJECT_BYTES, -1), (len(B.data) - 1, 1 << 20)],
    ids=["body-over-total", "object-over-max"],
)
async def test_over_cap_upload_is_rejected(
    cache_root: Path, max_object_bytes: int, slack: int
) -> None:
    """Over max_total_bytes or max_object_bytes: PayloadTooLargeError and no trace."""
    cache = InputCache(cache_root, max_object_bytes=max_object_bytes)
    before = snapshot(cache_root)
    body, content_type = upload(A, B)

    with pytest.raises(PayloadTooLargeError):
        await cache.ingest(chunks(body, 100), content_type, max_total_bytes=len(body) + slack)

    assert snapshot(cache_root) == before


async def test_manifest_declaring_more_than_the_total_cap_is_rejected_early(
    cache: InputCache,
) -> None:
    """Declared sizes over max_total_bytes fail at the manifest, before object bytes."""
    body, content_type = upload(B)

    with pytest.raises(PayloadTooLargeError, match="manifest declares"):
        await cache.ingest(chunks(body, 100), content_type, max_total_bytes=len(B.data) - 1)

    assert snapshot(cache.root) == {}


async def test_cancelled_upload_leaves_no_staging_file(cache: InputCache) -> None:
    """Cancelling mid-body removes the half-written staging file."""
    body, content_type = upload(B)
    midway = anyio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield body[: len(body) // 2]
        midway.set()
        await anyio.sleep_forever()

    stream = stalled()
    ingest = functools.partial(cache.ingest, max_total_bytes=len(body))
    async with anyio.create_task_group() as tg:
        tg.start_soon(ingest, stream, content_type)
        await midway.wait()
        assert len(snapshot(cache.root)) == 1  # the staging file of the half-sent object
        tg.cancel_scope.cancel()
    await stream.aclose()

    assert snapshot(cache.root) == {}
