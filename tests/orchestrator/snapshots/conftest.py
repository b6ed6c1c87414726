"""Fixtures for the snapshot store suite: every backend against real storage.

The S3 store talks to a real S3 HTTP endpoint, moto's ``ThreadedMotoServer``,
started once per session on a free port with one bucket; each test gets its own
key prefix. The directory store writes under the test's ``tmp_path``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
import pytest
from moto.server import ThreadedMotoServer

from sandcell_orchestrator.snapshots import (
    DirectorySnapshotStore,
    S3Settings,
    S3SnapshotStore,
    SnapshotStore,
)
from tests.orchestrator.snapshots import MIB

if TYPE_CHECKING:
    from types_boto3_s3.client import S3Client

ACCESS_KEY = "sandcell-test-access"
# Distinctive, so a test can search any message or repr for it.
SECRET_KEY = "sandcell-SECRET-7f3a9c1e5b"
BUCKET = "sandcell-snapshots"
REGION = "us-east-1"


def admin_client(endpoint: str) -> S3Client:
    """A boto3 client for looking behind the store's back (metadata, uploads, corruption)."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
    )


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of an in-process moto S3 server holding ``BUCKET``."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = admin_client(endpoint)
        try:
            client.create_bucket(Bucket=BUCKET)
        finally:
            client.close()
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_admin(s3_endpoint: str) -> Iterator[S3Client]:
    client = admin_client(s3_endpoint)
    yield client
    client.close()


@pytest.fixture
def s3_settings(s3_endpoint: str) -> S3Settings:
    """Settings for the moto bucket under a prefix of this test's own, with 5 MiB parts."""
    return S3Settings(
        endpoint=s3_endpoint,
        bucket=BUCKET,
        prefix=f"test-{uuid.uuid4().hex}",
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        region=REGION,
        part_size_bytes=5 * MIB,
    )


@pytest.fixture(params=["directory", "s3"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SnapshotStore]:
    """Each contract test runs against both backends."""
    backend: SnapshotStore
    if request.param == "directory":
        backend = DirectorySnapshotStore(tmp_path / "snapshots")
    else:
        backend = S3SnapshotStore(request.getfixturevalue("s3_settings"))
    async with backend:
        yield backend


@pytest.fixture
def leftovers(store: SnapshotStore, request: pytest.FixtureRequest) -> Callable[[], list[str]]:
    """Lists what a put may leave behind besides objects: temp files, uploads, staging."""
    if isinstance(store, DirectorySnapshotStore):
        root = store.root

        def temp_files() -> list[str]:
            return sorted(str(path) for path in root.rglob(".*"))

        return temp_files

    assert isinstance(store, S3SnapshotStore)
    prefix = store.settings.prefix
    admin: S3Client = request.getfixturevalue("s3_admin")

    def uploads_and_staging() -> list[str]:
        uploads = admin.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
        staged = admin.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/.staging/")
        return sorted(
            [f"upload:{upload['Key']}" for upload in uploads]
            + [f"staging:{item['Key']}" for item in staged.get("Contents", [])]
        )

    return uploads_and_staging
