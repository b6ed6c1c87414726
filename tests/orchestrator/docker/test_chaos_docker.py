"""``scripts/chaos.py --bounded --provider docker`` (issue 20): the bounded chaos run with
runner containers on podman's Docker API instead of local runners; the same invariants."""

from __future__ import annotations

from pathlib import Path

from tests.orchestrator.docker.conftest import Engine
from tests.orchestrator.serve.test_chaos import assert_bounded_invariants, bounded_run


def test_bounded_chaos_run_on_docker(engine: Engine, tmp_path: Path) -> None:
    """Two workers share the engine: either reaches a container the other launched
    through the record; kills, split brains and outages lose nothing committed."""
    report = bounded_run(
        tmp_path,
        "--provider",
        "docker",
        "--docker-host",
        engine.docker_host,
        "--docker-image",
        engine.image,
    )
    assert report["provider"] == "docker"
    assert_bounded_invariants(report)
