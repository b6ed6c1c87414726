"""On-disk layout: the commit marker, crash leftovers, tampering, and the directory itself."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sandcell_runner.errors import BadRequestError, ConfigError
from sandcell_runner.inputs.cache import InputCache
from tests.runner.inputs import MAX_OBJECT_BYTES, Blob, chunks, snapshot, upload

A = Blob("sess-A", "obj-1", b"alpha,beta\n1,2\n")
B = Blob("sess-A", "obj-2", b"bravo")


async def _stored(cache: InputCache, *blobs: Blob) -> None:
    body, content_type = upload(*blobs)
    await cache.ingest(chunks(body), content_type, max_total_bytes=len(body))


def _reopen(root: Path) -> InputCache:
    return InputCache(root, max_object_bytes=MAX_OBJECT_BYTES)


async def test_object_without_sidecar_is_not_present(cache: InputCache) -> None:
    """Bytes whose sidecar never landed (a crash mid-commit) do not count as present."""
    await _stored(cache, A)
    (cache.root / f"{A.key}.json").unlink()

    assert cache.missing([A.ref()]) == [A.ref()]
    assert not cache.verify(A.key)


async def test_sidecar_disagreeing_with_the_object_is_not_present(cache: InputCache) -> None:
    """A sidecar whose size differs from the object's, or that does not decode, is absent."""
    await _stored(cache, A, B)
    (cache.root / A.key).write_bytes(A.data + b"grown")
    (cache.root / f"{B.key}.json").write_bytes(b"{not json")

    assert cache.missing([A.ref(), B.ref()]) == [A.ref(), B.ref()]


async def test_reopening_sweeps_crash_leftovers(cache: InputCache) -> None:
    """Staging files and half-committed entries are removed when the cache is reopened."""
    await _stored(cache, A, B)
    (cache.root / ".tmp-abandoned").write_bytes(b"half an upload")
    (cache.root / f"{A.key}.json").unlink()
    (cache.root / B.key).unlink()
    unrelated = cache.root / "lost+found"
    unrelated.mkdir()

    _reopen(cache.root)

    assert sorted(p.name for p in cache.root.iterdir()) == ["lost+found"]


async def test_tampered_entry_fails_verify_and_can_be_discarded(cache: InputCache) -> None:
    """Same-size tampering passes the cheap check but not verify(); discard() evicts it."""
    await _stored(cache, A, B)
    (cache.root / A.key).write_bytes(A.data.upper())

    assert cache.missing([A.ref()]) == []
    assert not cache.verify(A.key)
    assert cache.verify(B.key)

    cache.discard(A.key)
    cache.discard(A.key)

    assert cache.missing([A.ref(), B.ref()]) == [A.ref()]
    assert sorted(p.name for p in cache.root.iterdir()) == [B.key, f"{B.key}.json"]


async def test_healing_push_replaces_a_mismatched_entry(cache: InputCache) -> None:
    """A push whose facts differ from a stored entry replaces both files."""
    await _stored(cache, A)
    (cache.root / f"{A.key}.json").write_bytes(
        (cache.root / f"{A.key}.json").read_bytes().replace(b"false", b"true")
    )

    await _stored(cache, A)

    assert cache.verify(A.key)
    assert (await cache.resolve(A.ref())).read_only is False


@pytest.mark.parametrize("key", ["../evil", "A" * 64, "", "0" * 63, "0" * 64 + "/x"])
def test_names_that_are_not_keys_never_touch_the_disk(cache: InputCache, key: str) -> None:
    """verify() and discard() refuse anything not shaped like a cache key."""
    (cache.root.parent / "evil").write_bytes(b"not the cache's to delete")
    before = (snapshot(cache.root), snapshot(cache.root.parent / "evil"))

    with pytest.raises(BadRequestError):
        cache.verify(key)
    with pytest.raises(BadRequestError):
        cache.discard(key)

    assert (snapshot(cache.root), snapshot(cache.root.parent / "evil")) == before


def test_existing_directory_is_tightened_to_0700(tmp_path: Path) -> None:
    """A pre-existing cache directory with loose permissions is made private."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o777)

    _reopen(root)

    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_directory_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    """The cache refuses a directory another user owns (they could swap its entries)."""
    if os.geteuid() != 0:
        pytest.fail("needs root to chown (run scripts/test as root)")
    root = tmp_path / "cache"
    root.mkdir()
    os.chown(root, 65534, 65534)

    with pytest.raises(ConfigError):
        _reopen(root)


def test_symlinked_directory_is_refused(tmp_path: Path) -> None:
    """The root must be a directory itself, not a symlink that could be re-pointed."""
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(tmp_path / "real")

    with pytest.raises(ConfigError):
        _reopen(tmp_path / "cache")
