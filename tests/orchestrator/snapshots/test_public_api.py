"""The snapshots package's public API: what it exports, and the URL-driven factory."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from sandcell_orchestrator import snapshots
from sandcell_orchestrator.errors import ConfigError
from sandcell_orchestrator.snapshots import (
    DirectorySnapshotStore,
    S3SnapshotStore,
    SnapshotStore,
    open_snapshot_store,
)


def test_all_is_pinned() -> None:
    assert sorted(snapshots.__all__) == [
        "DirectorySnapshotStore",
        "S3Settings",
        "S3SnapshotStore",
        "Snapshot",
        "SnapshotEntry",
        "SnapshotInfo",
        "SnapshotNotFoundError",
        "SnapshotStore",
        "SnapshotTooLargeError",
        "SnapshotUnavailableError",
        "open_snapshot_store",
        "validate_snapshot_key",
    ]
    for name in snapshots.__all__:
        assert hasattr(snapshots, name)


@pytest.mark.parametrize("backend", [DirectorySnapshotStore, S3SnapshotStore])
@pytest.mark.parametrize(
    "method", ["put", "get", "delete", "exists", "list", "close", "__aenter__", "__aexit__"]
)
def test_backends_match_the_protocol(backend: type, method: str) -> None:
    """Each backend's methods have the protocol's parameters and (a)sync-ness."""
    expected = getattr(SnapshotStore, method)
    actual = getattr(backend, method)
    assert list(inspect.signature(actual).parameters) == list(
        inspect.signature(expected).parameters
    )
    assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(expected)


@pytest.mark.parametrize("url", [None, ""])
def test_no_url_is_the_default_directory(url: str | None, tmp_path: Path) -> None:
    store = open_snapshot_store(url, default_dir=tmp_path / "default")
    assert isinstance(store, DirectorySnapshotStore)
    assert store.root == tmp_path / "default"


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("file:///var/lib/sandcell/snapshots", "/var/lib/sandcell/snapshots"),
        ("file://localhost/srv/snaps/", "/srv/snaps"),
        ("FILE:///with%20space", "/with space"),
    ],
)
def test_file_urls_are_directories(url: str, root: str, tmp_path: Path) -> None:
    store = open_snapshot_store(url, default_dir=tmp_path)
    assert isinstance(store, DirectorySnapshotStore)
    assert store.root == Path(root)


def test_s3_urls_are_s3_stores_configured_from_env(tmp_path: Path) -> None:
    env = {
        "SANDCELL_S3_ENDPOINT": "http://127.0.0.1:5000",
        "SANDCELL_S3_ACCESS_KEY": "ak",
        "SANDCELL_S3_SECRET_KEY": "sk",
    }
    store = open_snapshot_store("s3://snaps/prod", default_dir=tmp_path, env=env)
    assert isinstance(store, S3SnapshotStore)
    assert (store.settings.bucket, store.settings.prefix) == ("snaps", "prod")
    assert store.settings.endpoint == "127.0.0.1:5000"


@pytest.mark.parametrize(
    "url",
    ["gs://bucket", "file:relative/dir", "file://otherhost/x", "/plain/path", "s3://"],
)
def test_other_urls_are_config_errors(url: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="snapshot store URL"):
        open_snapshot_store(url, default_dir=tmp_path, env={"AWS_ACCESS_KEY_ID": "a"})
