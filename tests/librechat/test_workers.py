"""Two ``sandcell serve`` workers on one Redis and one S3 (moto's server) are one backend:
what the client uploads, runs or keeps through one is there through the other."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.librechat.conftest import KEY_A, Driver, Serve, node_driver, running_serve
from tests.orchestrator.conftest import (
    BUCKET,
    S3_ACCESS,
    S3_SECRET,
    S3Server,
    redis_url,
    running_s3,
)

__all__ = ["redis_url"]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with running_s3() as server:
        yield server


@pytest.fixture(scope="module")
def workers(s3: S3Server, redis_url: str) -> Iterator[tuple[Serve, Serve]]:
    env = {
        "SANDCELL_REGISTRY_URL": redis_url,
        "SANDCELL_SNAPSHOT_URL": f"s3://{BUCKET}/lc-{uuid.uuid4().hex[:8]}",
        "SANDCELL_S3_ENDPOINT": s3.endpoint,
        "SANDCELL_S3_ACCESS_KEY": S3_ACCESS,
        "SANDCELL_S3_SECRET_KEY": S3_SECRET,
    }
    with running_serve("lc-w1-", **env) as one, running_serve("lc-w2-", **env) as two:
        yield one, two


@pytest.fixture(scope="module")
def driver(workers: tuple[Serve, Serve]) -> Iterator[Driver]:
    with node_driver(workers[0]) as running:
        yield running


def params(serve: Serve, **more: Any) -> dict[str, Any]:
    return {"baseUrl": serve.base, "authHeaders": {"X-API-Key": KEY_A}, "user_id": "u1", **more}


def test_files_and_sessions_cross_workers(workers: tuple[Serve, Serve], driver: Driver) -> None:
    """Upload through worker 1, run through worker 2, download the output through
    worker 1; a stateful session written through worker 1 is read through worker 2."""
    one, two = workers
    uploaded = one.upload([("in.csv", b"a,b\n1,2\n")], user="u1").json()
    ref = {
        "id": uploaded["files"][0]["fileId"],
        "resource_id": "u1",
        "name": "in.csv",
        "storage_session_id": uploaded["storage_session_id"],
        "kind": "user",
    }
    run = driver.invoke(
        params=params(two),
        args={
            "lang": "py",
            "code": "open('out.txt', 'w').write(open('in.csv').read().replace(',', ';'))",
        },
        _injected_files=[ref],
    )
    assert run["ok"], run
    (out,) = run["artifact"]["files"]
    with one.client() as client:
        got = client.get(
            f"/download/{out['storage_session_id']}/{out['id']}",
            params={"kind": "user", "id": "u1"},
        )
    assert got.content == b"a;b\n1;2\n"

    stateful = {"statefulSessions": True, "executionProfile": "stateful"}
    hint = f"conv-{uuid.uuid4().hex[:8]}"
    write = driver.invoke(
        params=params(one, runtimeSessionHint=hint, **stateful),
        args={"lang": "py", "code": "open('/mnt/data/kept.txt', 'w').write('across workers')"},
    )
    assert write["ok"], write
    read = driver.invoke(
        params=params(two, runtimeSessionHint=hint, **stateful),
        args={"lang": "py", "code": "print(open('/mnt/data/kept.txt').read())"},
    )
    assert read["ok"], read
    assert read["content"].startswith("stdout:\nacross workers"), read


def test_a_continuation_on_the_other_worker_is_a_clear_400(workers: tuple[Serve, Serve]) -> None:
    """A paused programmatic run is held by the worker that answered its round: its
    continuation on the other worker is 400 invalid_continuation (never a 5xx), and the
    run is still there for the worker that holds it."""
    one, two = workers
    with one.client() as a, two.client() as b:
        first = a.post(
            "/exec/programmatic",
            json={
                "code": "print(await get_weather(city='Oslo'))",
                "tools": [{"name": "get_weather"}],
            },
        )
        assert first.status_code == 200, first.text
        paused = first.json()
        assert paused["status"] == "tool_call_required", paused
        (call,) = paused["tool_calls"]
        answer = {"call_id": call["id"], "result": '{"temp_c": 3}', "is_error": False}
        body = {"continuation_token": paused["continuation_token"], "tool_results": [answer]}
        elsewhere = b.post("/exec/programmatic", json=body)
        assert elsewhere.status_code == 400, elsewhere.text
        assert elsewhere.json()["error"] == "invalid_continuation"
        finished = a.post("/exec/programmatic", json=body)
        assert finished.status_code == 200, finished.text
        assert finished.json()["status"] == "completed", finished.text
        assert finished.json()["stdout"] == "{'temp_c': 3}\n"
