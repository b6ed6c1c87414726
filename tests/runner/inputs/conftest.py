"""Fixtures: a cache on the real filesystem and a real HTTP file server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.inputs.cache import InputCache
from tests.runner.inputs import MAX_OBJECT_BYTES, FileServer


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    server = FileServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "input-cache"


@pytest.fixture
def cache(cache_root: Path) -> InputCache:
    return InputCache(cache_root, max_object_bytes=MAX_OBJECT_BYTES)


@pytest.fixture
def pulling_cache(cache_root: Path, file_server: FileServer) -> InputCache:
    return InputCache(
        cache_root,
        max_object_bytes=MAX_OBJECT_BYTES,
        file_server_url=file_server.url,
        http_timeout_s=5,
    )
