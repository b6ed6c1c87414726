"""LibreChat's per-tenant concurrency limit across two workers on one redis-server
(issue 20): a run in flight on one worker fills the tenant's slot for both, and a
worker that crashes mid-run holds its slot only until the slot's TTL passes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from sandcell_orchestrator.serve.librechat.limits import TenantLimiter
from tests.librechat.conftest import KEY_A, Serve, running_serve
from tests.orchestrator.conftest import redis_url, running_s3
from tests.orchestrator.serve.fleet import fleet_env

__all__ = ["redis_url"]

SLOT_TTL_S = 3
LONG = {"lang": "py", "code": "import time; time.sleep(30)", "timeout": 60_000}
SHORT = {"lang": "py", "code": "print('ran')"}


@pytest.fixture
def workers(redis_url: str) -> Iterator[tuple[Serve, Serve]]:
    with running_s3() as s3:
        env = fleet_env(redis_url, s3, prefix="lc-limit")
        env["SANDCELL_LIBRECHAT_MAX_CONCURRENT"] = "1"
        env["SANDCELL_LIBRECHAT_SLOT_TTL_S"] = str(SLOT_TTL_S)
        with running_serve("lc-lim-1-", **env) as one, running_serve("lc-lim-2-", **env) as two:
            yield one, two


def exec_on(serve: Serve, body: dict[str, object]) -> httpx.Response:
    with serve.client(KEY_A) as client:
        return client.post("/exec", json=body)


def start_long(serve: Serve) -> tuple[threading.Thread, dict[str, httpx.Response | Exception]]:
    results: dict[str, httpx.Response | Exception] = {}

    def run() -> None:
        try:
            results["long"] = exec_on(serve, LONG)
        except httpx.HTTPError as exc:
            results["long"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


def until_held(redis_url: str, long: threading.Thread) -> None:
    """Wait until the long run holds the tenant's one slot (in Redis, where every worker
    counts it): asking a worker before would race the long run for the slot."""
    key = f"sandcell:slots:{TenantLimiter.scope('tenant-a')}"
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 60
        while client.zcard(key) == 0 and long.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.close()


def test_a_run_on_one_worker_fills_the_slot_on_the_other(
    workers: tuple[Serve, Serve], redis_url: str
) -> None:
    """With MAX_CONCURRENT=1 a run in flight through worker one makes worker two answer
    429 rate_limited; once it ends, worker two runs again."""
    one, two = workers
    thread, results = start_long(one)
    try:
        until_held(redis_url, thread)
        limited = exec_on(two, SHORT)
        assert limited.status_code == 429, (limited.text, results)
        assert limited.json()["error"] == "rate_limited"
        assert limited.json()["retry_after_seconds"] >= 1
    finally:
        thread.join(timeout=120)
    long = results["long"]
    assert isinstance(long, httpx.Response)
    assert long.status_code == 200, long.text
    assert exec_on(two, SHORT).status_code == 200


def test_a_crashed_workers_slot_lapses(workers: tuple[Serve, Serve], redis_url: str) -> None:
    """Worker one SIGKILLed mid-run stops renewing its slot: worker two refuses while the
    slot lives and admits the tenant again within the slot's TTL after the crash."""
    one, two = workers
    thread, results = start_long(one)
    try:
        until_held(redis_url, thread)
        limited = exec_on(two, SHORT)
        assert limited.status_code == 429, (limited.text, results)
        os.killpg(one.process.pid, signal.SIGKILL)
        one.process.wait()
    finally:
        thread.join(timeout=120)
    deadline = time.monotonic() + SLOT_TTL_S * 10
    while True:
        answer = exec_on(two, SHORT)
        if answer.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert answer.status_code == 200, answer.text
    assert "ran" in answer.text
