"""Several ``sandcell serve`` workers on one Redis and one S3 (moto's server), as deployed."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import boto3

from tests.orchestrator.conftest import BUCKET, S3_ACCESS, S3_SECRET, S3Server


@contextlib.contextmanager
def shared_s3() -> Iterator[S3Server]:
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


def fleet_env(redis_url: str, s3: S3Server, *, prefix: str) -> dict[str, str]:
    """The settings every worker of one deployment shares (docs/deployment.md)."""
    return {
        "SANDCELL_REGISTRY_URL": redis_url,
        "SANDCELL_SNAPSHOT_URL": f"s3://{BUCKET}/{prefix}-{uuid.uuid4().hex[:8]}",
        "SANDCELL_S3_ENDPOINT": s3.endpoint,
        "SANDCELL_S3_ACCESS_KEY": S3_ACCESS,
        "SANDCELL_S3_SECRET_KEY": S3_SECRET,
    }
