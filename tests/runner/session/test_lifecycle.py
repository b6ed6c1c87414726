"""Warmup at boot and the reaper of crashed jobs' workspaces."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from tests.fixtures.runner_process import RunnerProcess
from tests.runner.conftest import StartRunner
from tests.runner.session.helpers import SessionClient


def wait_for_warmup(runner: RunnerProcess, state: str, timeout_s: float = 20) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health: dict[str, object] = httpx.get(
            runner.url + "/health", headers=runner.headers()
        ).json()
        if health["warmup"] == state:
            return health
        time.sleep(0.05)
    raise AssertionError(f"warmup never reached {state}")


def test_warmup_runs_without_blocking_readiness(runner_factory: StartRunner) -> None:
    runner = runner_factory(SANDCELL_RUNNER_WARMUP_COMMAND="sleep 2; echo warmed > /dev/null")
    health_url = runner.url + "/health"
    assert httpx.get(health_url, headers=runner.headers()).json()["warmup"] == "running"
    # Readiness and work are not held back by the warmup.
    response = httpx.post(
        runner.url + "/v1/execute",
        json={"language": "bash", "code": "echo ready"},
        headers=runner.headers(),
    )
    assert response.json()["stdout"] == "ready\n"
    health = wait_for_warmup(runner, "done")
    assert health["session_id"] is None


def test_warmup_failure_is_reported(runner_factory: StartRunner) -> None:
    runner = runner_factory(SANDCELL_RUNNER_WARMUP_COMMAND="exit 3")
    wait_for_warmup(runner, "failed")
    assert "warmup command failed" in runner.log()


def test_warmup_does_not_see_the_token(runner_factory: StartRunner, tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    runner = runner_factory(SANDCELL_RUNNER_WARMUP_COMMAND=f"env > {out}")
    wait_for_warmup(runner, "done")
    assert runner.token not in out.read_text()


def test_reaper_removes_only_stale_job_workspaces(runner_factory: StartRunner) -> None:
    runner = runner_factory(
        SANDCELL_RUNNER_SESSIONS="1",
        SANDCELL_RUNNER_REAP_AGE_S="60",
        SANDCELL_RUNNER_REAP_INTERVAL_S="1",
    )
    with SessionClient(runner) as session:
        session.execute("open('keep.txt', 'w').write('live state')")
        workspace = session.workspace()
        # Seed: a crashed job's leftovers, an old staging-like session dir, and make the
        # live session workspace and the input cache look ancient too.
        stale_job = runner.workspace_root / "jobs" / "1-deadbeef"
        (stale_job / "ws").mkdir(parents=True)
        (stale_job / "ws" / "junk").write_text("x")
        stale_session = runner.workspace_root / "session" / "ws-99"
        stale_session.mkdir()
        cache_entry = runner.input_cache / ("a" * 64)
        cache_entry.write_bytes(b"cached")
        old = time.time() - 7200
        for path in (stale_job, stale_session, workspace, runner.input_cache, cache_entry):
            os.utime(path, (old, old))
        deadline = time.monotonic() + 15
        while (stale_job.exists() or stale_session.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not stale_job.exists()
        assert not stale_session.exists()
        assert (workspace / "keep.txt").read_text() == "live state"
        assert cache_entry.read_bytes() == b"cached"
        assert session.execute("print(open('keep.txt').read())")["stdout"] == "live state\n"
