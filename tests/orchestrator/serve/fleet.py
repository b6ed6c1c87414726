"""Several ``sandcell serve`` workers on one Redis and one S3 (moto's server), as deployed."""

from __future__ import annotations

import uuid

from tests.orchestrator.conftest import BUCKET, S3_ACCESS, S3_SECRET, S3Server


def fleet_env(redis_url: str, s3: S3Server, *, prefix: str) -> dict[str, str]:
    """The settings every worker of one deployment shares (docs/deployment.md)."""
    return {
        "SANDCELL_REGISTRY_URL": redis_url,
        "SANDCELL_SNAPSHOT_URL": f"s3://{BUCKET}/{prefix}-{uuid.uuid4().hex[:8]}",
        "SANDCELL_S3_ENDPOINT": s3.endpoint,
        "SANDCELL_S3_ACCESS_KEY": S3_ACCESS,
        "SANDCELL_S3_SECRET_KEY": S3_SECRET,
    }
