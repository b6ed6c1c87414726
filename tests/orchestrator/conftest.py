"""Fixtures shared by the orchestrator suites: a real S3 endpoint (moto) that can go down."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

from sandcell_orchestrator.snapshots import S3Settings

S3_ACCESS = "exec-test-access"
S3_SECRET = "exec-test-SECRET-9d8c7b6a"
BUCKET = "sandcell-exec"


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


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
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
