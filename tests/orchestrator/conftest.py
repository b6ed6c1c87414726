"""Fixtures shared by the orchestrator suites: a real S3 endpoint (moto) that can go down,
and the real Redis the tests use (``$SANDCELL_TEST_REDIS_URL``, or a private redis-server)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import redis
from moto.server import ThreadedMotoServer

from sandcell_orchestrator.snapshots import S3Settings

S3_ACCESS = "exec-test-access"
S3_SECRET = "exec-test-SECRET-9d8c7b6a"
BUCKET = "sandcell-exec"
REDIS_URL_ENV = "SANDCELL_TEST_REDIS_URL"


class S3Server:
    """A moto S3 server that a test can stop and start again (an outage)."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def settings(self, prefix: str) -> S3Settings:
        return S3Settings(
            endpoint=self.endpoint,
            bucket=BUCKET,
            prefix=prefix,
            access_key=S3_ACCESS,
            secret_key=S3_SECRET,
            region="us-east-1",
            connect_timeout_s=2.0,
            read_timeout_s=10.0,
        )


@contextlib.contextmanager
def running_s3() -> Iterator[S3Server]:
    """A moto S3 server with the test bucket, stopped at the end."""
    server = S3Server()
    server.start()
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=S3_ACCESS,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=BUCKET)
    client.close()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    with running_s3() as server:
        yield server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _worker_database(url: str) -> str:
    """``url`` on a database of this pytest-xdist worker's own (``gw0`` is 1, ``gw1`` 2...):
    what a test keys fleet-wide (a tenant's LibreChat slots) must not be counted by a test
    that runs at the same moment in another worker. Database 0 without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    base, _, _ = url.rpartition("/")
    return f"{base}/{int(worker.removeprefix('gw')) % 15 + 1}"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Redis the tests use: ``$SANDCELL_TEST_REDIS_URL``, or a private one."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        yield _worker_database(url)
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            f"{REDIS_URL_ENV} is unset and redis-server is not installed: run scripts/test, "
            "or `source scripts/services; start_test_services` before pytest"
        )
    port = _free_port()
    workdir: Path = tmp_path_factory.mktemp("redis")
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    argv += ["no", "--daemonize", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = _worker_database(f"redis://127.0.0.1:{port}/0")
    try:
        client = redis.Redis.from_url(url)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    if client.ping():
                        break
                except redis.exceptions.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        pytest.fail(f"private redis-server on port {port} did not start")
                    time.sleep(0.05)
        finally:
            client.close()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
