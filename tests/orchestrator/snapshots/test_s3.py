"""S3SnapshotStore specifics: settings, error mapping, secrets, metadata and memory."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import time
import traceback
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import pytest
import urllib3
from minio.error import InvalidResponseError, S3Error, ServerError

from sandcell_orchestrator.errors import CheckpointError, ConfigError
from sandcell_orchestrator.snapshots import (
    S3Settings,
    S3SnapshotStore,
    SnapshotNotFoundError,
    SnapshotUnavailableError,
)
from sandcell_orchestrator.snapshots.s3_errors import translate_error
from sandcell_protocol import checkpoint_key, checkpoint_prefix, runtime_session_id
from tests.orchestrator.snapshots import MIB, new_key, payload, read_all, stream_of
from tests.orchestrator.snapshots.conftest import (
    ACCESS_KEY,
    BUCKET,
    REGION,
    SECRET_KEY,
    admin_client,
)

if TYPE_CHECKING:
    from types_boto3_s3.client import S3Client

CAP = 128 * MIB


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _assert_secret_free(error: BaseException) -> None:
    rendered = "".join(traceback.format_exception(error))
    for text in (str(error), repr(error), rendered):
        assert SECRET_KEY not in text


# --- settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "secure", "expected_endpoint", "expected_secure"),
    [
        ("http://127.0.0.1:5000", True, "127.0.0.1:5000", False),
        ("https://minio.example:9443", False, "minio.example:9443", True),
        ("https://s3.example.com", False, "s3.example.com:443", True),
        ("http://minio.local/", True, "minio.local:80", False),
        ("HTTP://Minio.Local:9000", True, "minio.local:9000", False),
        ("minio.local", True, "minio.local:9000", True),
        ("minio.local", False, "minio.local:9000", False),
        ("minio.local:9100", True, "minio.local:9100", True),
        ("[::1]", False, "[::1]:9000", False),
        ("http://[::1]:5000", True, "[::1]:5000", False),
    ],
)
def test_endpoint_parsing(
    endpoint: str, secure: bool, expected_endpoint: str, expected_secure: bool
) -> None:
    """A scheme keeps its URL's port and decides secure; only a bare host gets 9000."""
    settings = S3Settings(endpoint=endpoint, bucket=BUCKET, secure=secure)
    assert (settings.endpoint, settings.secure) == (expected_endpoint, expected_secure)


@pytest.mark.parametrize(
    "endpoint",
    [
        "",
        "ftp://minio.local",
        "http://",
        "http://minio.local/bucket",
        "http://minio.local?x=1",
        "minio.local:99999",
        "minio.local:0",
        "minio.local:port",
        "bad_host!",
        f"http://key:{SECRET_KEY}@minio.local",
    ],
)
def test_bad_endpoints_are_config_errors(endpoint: str) -> None:
    """The message names the field and never echoes a credential."""
    with pytest.raises(ConfigError, match=r"^endpoint: ") as caught:
        S3Settings(endpoint=endpoint, bucket=BUCKET)
    _assert_secret_free(caught.value)


def test_settings_repr_hides_the_secret(s3_settings: S3Settings) -> None:
    """Neither the settings nor the store show the secret key."""
    store = S3SnapshotStore(s3_settings)
    for text in (repr(s3_settings), str(s3_settings), repr(store)):
        assert SECRET_KEY not in text
    assert ACCESS_KEY in repr(s3_settings)


def test_from_env_reads_the_sandcell_variables() -> None:
    """SANDCELL_S3_* configure everything; the URL gives bucket and prefix."""
    env = {
        "SANDCELL_S3_ENDPOINT": "http://127.0.0.1:5000",
        "SANDCELL_S3_ACCESS_KEY": ACCESS_KEY,
        "SANDCELL_S3_SECRET_KEY": SECRET_KEY,
        "SANDCELL_S3_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": "ignored",
        "AWS_SECRET_ACCESS_KEY": "ignored",
    }
    settings = S3Settings.from_env(env, "s3://snaps/tenant-a/checkpoints/")
    assert settings.endpoint == "127.0.0.1:5000"
    assert settings.secure is False
    assert (settings.bucket, settings.prefix) == ("snaps", "tenant-a/checkpoints")
    assert (settings.access_key, settings.secret_key) == (ACCESS_KEY, SECRET_KEY)
    assert settings.region == "eu-west-1"


def test_from_env_falls_back_to_aws_then_minio_variables() -> None:
    """Standard variables fill in; with none, AWS's endpoint and us-east-1."""
    aws = S3Settings.from_env(
        {"AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "sk", "AWS_REGION": "eu-north-1"},
        "s3://snaps",
    )
    assert (aws.access_key, aws.secret_key, aws.region) == ("ak", "sk", "eu-north-1")
    assert (aws.endpoint, aws.secure, aws.prefix) == ("s3.amazonaws.com:443", True, "")

    minio = S3Settings.from_env(
        {"MINIO_ROOT_USER": "root", "MINIO_ROOT_PASSWORD": "pw", "AWS_ENDPOINT_URL": "minio"},
        "s3://snaps/p",
    )
    assert (minio.access_key, minio.secret_key) == ("root", "pw")
    assert (minio.endpoint, minio.region) == ("minio:9000", "us-east-1")


CREDS = {"SANDCELL_S3_ACCESS_KEY": ACCESS_KEY, "SANDCELL_S3_SECRET_KEY": SECRET_KEY}


@pytest.mark.parametrize(
    ("env", "url", "variable"),
    [
        ({**CREDS, "SANDCELL_S3_ENDPOINT": "ftp://x"}, "s3://snaps", "SANDCELL_S3_ENDPOINT"),
        ({**CREDS, "AWS_ENDPOINT_URL": "http://x/path"}, "s3://snaps", "AWS_ENDPOINT_URL"),
        ({**CREDS, "SANDCELL_S3_REGION": "eu west"}, "s3://snaps", "SANDCELL_S3_REGION"),
        ({}, "s3://snaps", "SANDCELL_S3_ACCESS_KEY"),
        ({"SANDCELL_S3_ACCESS_KEY": "ak"}, "s3://snaps", "SANDCELL_S3_SECRET_KEY"),
        ({"SANDCELL_S3_SECRET_KEY": SECRET_KEY}, "s3://snaps", "SANDCELL_S3_ACCESS_KEY"),
        (
            {"SANDCELL_S3_ACCESS_KEY": "ak", "SANDCELL_S3_SECRET_KEY": f"a {SECRET_KEY}"},
            "s3://snaps",
            "SANDCELL_S3_SECRET_KEY",
        ),
        (
            {"AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": f"{SECRET_KEY}\x07"},
            "s3://snaps",
            "AWS_SECRET_ACCESS_KEY",
        ),
        (CREDS, "s3://Bad_Bucket", "snapshot store URL"),
        (CREDS, "s3://", "snapshot store URL"),
        (CREDS, "s3://snaps/../x", "snapshot store URL"),
        (CREDS, "s3://snaps?versioning=1", "snapshot store URL"),
        (CREDS, f"s3://ak:{SECRET_KEY}@snaps", "snapshot store URL"),
    ],
)
def test_from_env_names_the_bad_variable(env: dict[str, str], url: str, variable: str) -> None:
    """A bad value is a ConfigError naming its variable, never echoing a secret."""
    with pytest.raises(ConfigError, match=f"^{variable}: ") as caught:
        S3Settings.from_env(env, url)
    _assert_secret_free(caught.value)


def test_from_env_strips_surrounding_whitespace() -> None:
    """A secret file's trailing newline is not part of the secret."""
    env = {"SANDCELL_S3_ACCESS_KEY": f" {ACCESS_KEY}", "SANDCELL_S3_SECRET_KEY": f"{SECRET_KEY}\n"}
    settings = S3Settings.from_env(env, "s3://snaps")
    assert (settings.access_key, settings.secret_key) == (ACCESS_KEY, SECRET_KEY)


def test_credential_pairs_are_never_mixed() -> None:
    """A SANDCELL key with only an AWS secret is an error, not a silent mix."""
    env = {"SANDCELL_S3_ACCESS_KEY": "ak", "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    with pytest.raises(ConfigError, match=r"^SANDCELL_S3_SECRET_KEY: "):
        S3Settings.from_env(env, "s3://snaps")


# --- errors -------------------------------------------------------------------


async def test_endpoint_down_is_retryable_and_names_no_secret() -> None:
    """Connection refused maps to a retryable CheckpointError naming the endpoint only."""
    port = _closed_port()
    settings = S3Settings(
        endpoint=f"http://127.0.0.1:{port}",
        bucket=BUCKET,
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        region=REGION,
        connect_timeout_s=2.0,
    )
    key = new_key()
    async with S3SnapshotStore(settings) as store:

        async def get() -> None:
            async with store.get(key, max_bytes=CAP):
                pass

        attempts: list[Callable[[], Awaitable[object]]] = [
            lambda: store.put(key, stream_of(b"state"), max_bytes=CAP),
            get,
            lambda: store.exists(key),
            lambda: store.delete(key),
        ]
        errors: list[CheckpointError] = []
        for attempt in attempts:
            with pytest.raises(SnapshotUnavailableError) as caught:
                await attempt()
            errors.append(caught.value)
    for error in errors:
        assert isinstance(error, CheckpointError)
        assert error.retryable is True
        assert f"127.0.0.1:{port}" in str(error)
        _assert_secret_free(error)


def _s3_error(code: str) -> S3Error:
    response = urllib3.HTTPResponse(body=b"", status=400)
    return S3Error(response, code, "message", "/snaps/key", "request-id", "host-id")


@pytest.mark.parametrize(
    ("foreign", "expected", "retryable"),
    [
        (_s3_error("NoSuchKey"), SnapshotNotFoundError, False),
        (_s3_error("SlowDown"), SnapshotUnavailableError, True),
        (_s3_error("PreconditionFailed"), SnapshotUnavailableError, True),
        (_s3_error("AccessDenied"), CheckpointError, False),
        (_s3_error("NoSuchBucket"), CheckpointError, False),
        (
            ServerError("server failed with HTTP status code 502", 502),
            SnapshotUnavailableError,
            True,
        ),
        (InvalidResponseError(502, "text/html", "<html>"), SnapshotUnavailableError, True),
        (
            urllib3.exceptions.MaxRetryError(
                cast(Any, None),
                "/x",
                urllib3.exceptions.NewConnectionError(cast(Any, None), "refused"),
            ),
            SnapshotUnavailableError,
            True,
        ),
        (urllib3.exceptions.ProtocolError("reset"), SnapshotUnavailableError, True),
        (ConnectionResetError(104, "reset"), SnapshotUnavailableError, True),
        (ValueError("invalid object name"), CheckpointError, False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None,
)
def test_foreign_errors_map_to_checkpoint_errors(
    foreign: BaseException, expected: type[CheckpointError], retryable: bool
) -> None:
    """Every foreign error becomes a CheckpointError with the right retryability."""
    error = translate_error(foreign, operation="get", key="k", endpoint="http://s3:9000")
    assert type(error) is expected
    assert error.retryable is retryable
    assert "http://s3:9000" in str(error)


# --- what goes over the wire ----------------------------------------------------


class RecordingPoolManager(urllib3.PoolManager):
    """A real transport that remembers each request's method and path."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str]] = []
        self.queries: list[str] = []

    def urlopen(  # type: ignore[override]  # as urllib3's own PoolManager.urlopen
        self, method: str, url: str, redirect: bool = True, **kw: Any
    ) -> urllib3.BaseHTTPResponse:
        parsed = urllib3.util.parse_url(url)
        self.requests.append((method, parsed.path or ""))
        self.queries.append(parsed.query or "")
        return super().urlopen(method, url, redirect=redirect, **kw)


async def test_over_cap_get_sends_no_get_request(s3_settings: S3Settings) -> None:
    """The size comes from a HEAD; an over-cap object is never downloaded."""
    key = new_key()
    transport = RecordingPoolManager()
    async with S3SnapshotStore(s3_settings, http_client=transport) as store:
        await store.put(key, stream_of(payload(2 * MIB)), max_bytes=CAP)
        transport.requests.clear()

        with pytest.raises(CheckpointError, match="over the cap"):
            async with store.get(key, max_bytes=MIB):
                pytest.fail("entered an over-cap snapshot")

    assert [method for method, _ in transport.requests] == ["HEAD"]


async def test_a_page_is_one_list_request_from_its_marker(s3_settings: S3Settings) -> None:
    """A listing with ``limit`` (under S3's 1,000 keys a response) is one ListObjectsV2
    request that starts after the marker: the keys before it are never sent."""
    session = runtime_session_id("tenant", "user", uuid.uuid4().hex)
    keys = [checkpoint_key(session, g) for g in range(1, 6)]
    transport = RecordingPoolManager()
    async with S3SnapshotStore(s3_settings, http_client=transport) as store:
        for key in keys:
            await store.put(key, stream_of(b"x"), max_bytes=CAP)
        transport.requests.clear()
        transport.queries.clear()
        page = await store.list(checkpoint_prefix(session), start_after=keys[1], limit=2)

    assert [entry.key for entry in page] == keys[2:4]
    assert [method for method, _ in transport.requests] == ["GET"]
    (query,) = transport.queries
    assert "start-after=" in query
    assert "list-type=2" in query


async def test_sha256_is_object_metadata_and_staging_is_cleaned(
    s3_settings: S3Settings, s3_admin: S3Client
) -> None:
    """The object carries x-amz-meta-sha256; no staging object or upload survives a put."""
    key = new_key()
    data = payload(11 * MIB, seed=11)
    async with S3SnapshotStore(s3_settings) as store:
        info = await store.put(key, stream_of(data), max_bytes=CAP)

    head = s3_admin.head_object(Bucket=BUCKET, Key=f"{s3_settings.prefix}/{key}")
    assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest() == info.sha256
    assert head["ContentLength"] == len(data)
    listed = s3_admin.list_objects_v2(Bucket=BUCKET, Prefix=s3_settings.prefix)
    assert [item["Key"] for item in listed["Contents"]] == [f"{s3_settings.prefix}/{key}"]
    uploads = s3_admin.list_multipart_uploads(Bucket=BUCKET, Prefix=s3_settings.prefix)
    assert uploads.get("Uploads", []) == []


async def test_object_without_recorded_sha256_is_refused(
    s3_settings: S3Settings, s3_admin: S3Client
) -> None:
    """An object written behind our back (no digest) is a CheckpointError, not trusted."""
    key = new_key()
    s3_admin.put_object(Bucket=BUCKET, Key=f"{s3_settings.prefix}/{key}", Body=b"foreign")
    async with S3SnapshotStore(s3_settings) as store:
        assert await store.exists(key) is True
        with pytest.raises(CheckpointError, match="no recorded sha256"):
            async with store.get(key, max_bytes=CAP):
                pass


async def test_corrupt_body_fails_at_the_end_of_the_stream(
    s3_settings: S3Settings, s3_admin: S3Client
) -> None:
    """Bytes that do not match the recorded sha256 raise before the stream ends cleanly."""
    key = new_key()
    s3_admin.put_object(
        Bucket=BUCKET,
        Key=f"{s3_settings.prefix}/{key}",
        Body=b"tampered",
        Metadata={"sha256": hashlib.sha256(b"original").hexdigest()},
    )
    async with S3SnapshotStore(s3_settings) as store:
        with pytest.raises(CheckpointError, match="sha256 does not match"):
            await read_all(store, key, max_bytes=CAP)


# --- memory -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def out_of_process_s3() -> Iterator[str]:
    """A moto server in a child process, so its own buffers are not counted as ours."""
    port = _free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail(f"moto server on port {port} did not start")
                time.sleep(0.1)
        client = admin_client(endpoint)
        try:
            client.create_bucket(Bucket=BUCKET)
        finally:
            client.close()
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_a_64_mib_put_keeps_memory_bounded(out_of_process_s3: str) -> None:
    """Peak traced allocation during a 64 MiB put stays under 40 MiB (default part size)."""
    block = payload(MIB, seed=12)
    digest = hashlib.sha256()
    for _ in range(64):
        digest.update(block)

    async def stream() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield block  # the same object each time: the producer allocates nothing

    settings = S3Settings(
        endpoint=out_of_process_s3,
        bucket=BUCKET,
        prefix="memory",
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        region=REGION,
    )
    key = new_key()
    async with S3SnapshotStore(settings) as store:
        await store.exists(key)  # warm the connection pool and lazy imports
        tracemalloc.start()
        try:
            baseline, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            info = await store.put(key, stream(), max_bytes=CAP)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert (await store.exists(key)) is True

    assert info.size == 64 * MIB
    assert info.sha256 == digest.hexdigest()
    assert peak - baseline < 40 * MIB, f"peak grew by {(peak - baseline) / MIB:.1f} MiB"
