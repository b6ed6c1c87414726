"""A keyed LibreChat exec runs once (issue 20): its retry gets the first run's answer,
whose files still download, through the other worker and after Redis forgot it.

LibreChat's own client (``@librechat/agents``, driven by ``driver.cjs``) sends the
``Idempotency-Key`` in its ``authHeaders``, as a LibreChat deployment would set it.
Two ``sandcell serve`` workers share a private redis-server (so a FLUSHALL wipes only
this module's) and moto's S3. A run counts its runs in the session's workspace and
writes an output file naming its count: a second run shows as a 2, and as other file
ids in its answer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.fixtures.private_redis import private_redis_server
from tests.librechat.conftest import KEY_A, Driver, Serve, node_driver, running_serve
from tests.orchestrator.conftest import BUCKET, S3_ACCESS, S3_SECRET, S3Server, running_s3

COUNT = (
    "open('runs', 'a').write('x\\n')\n"
    "n = len(open('runs').read().splitlines())\n"
    "open('/mnt/data/out.txt', 'w').write(f'run {n}')\n"
    "print(n)\n"
)
STATEFUL = {"statefulSessions": True, "executionProfile": "stateful"}


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with private_redis_server(Path(tmp_path_factory.mktemp("lc-once-redis"))) as server:
        yield server.url


@pytest.fixture(scope="module")
def workers(private_redis: str) -> Iterator[tuple[Serve, Serve]]:
    s3: S3Server
    with running_s3() as s3:
        env = {
            "SANDCELL_REGISTRY_URL": private_redis,
            "SANDCELL_SNAPSHOT_URL": f"s3://{BUCKET}/lc-once-{uuid.uuid4().hex[:8]}",
            "SANDCELL_S3_ENDPOINT": s3.endpoint,
            "SANDCELL_S3_ACCESS_KEY": S3_ACCESS,
            "SANDCELL_S3_SECRET_KEY": S3_SECRET,
        }
        with running_serve("lc-o1-", **env) as one, running_serve("lc-o2-", **env) as two:
            yield one, two


@pytest.fixture(scope="module")
def driver(workers: tuple[Serve, Serve]) -> Iterator[Driver]:
    with node_driver(workers[0]) as running:
        yield running


def params(serve: Serve, key: str | None, hint: str | None = None) -> dict[str, Any]:
    headers = {"X-API-Key": KEY_A} | ({"Idempotency-Key": key} if key else {})
    more: dict[str, Any] = {} if hint is None else {"runtimeSessionHint": hint, **STATEFUL}
    return {"baseUrl": serve.base, "authHeaders": headers, "user_id": "u1", **more}


def run(driver: Driver, serve: Serve, *, key: str | None, hint: str | None) -> dict[str, Any]:
    answer = driver.invoke(params=params(serve, key, hint), args={"lang": "py", "code": COUNT})
    assert answer["ok"], answer
    return answer


def out_file(answer: dict[str, Any]) -> dict[str, Any]:
    (out,) = [f for f in answer["artifact"]["files"] if f["name"] == "out.txt"]
    return out


def downloaded(serve: Serve, file: dict[str, Any]) -> bytes:
    with serve.client() as client:
        got = client.get(
            f"/download/{file['storage_session_id']}/{file['id']}",
            params={"kind": "user", "id": "u1"},
        )
    assert got.status_code == 200, got.text
    return got.content


def ran_once(driver: Driver, serve: Serve, hint: str) -> None:
    """The keyed job ran exactly once: the next unkeyed turn of the session counts 2."""
    assert run(driver, serve, key=None, hint=hint)["content"].startswith("stdout:\n2\n")


def test_a_keyed_retry_through_the_other_worker_gets_the_same_answer(
    workers: tuple[Serve, Serve], driver: Driver
) -> None:
    """No wipe: the retry reaches the other worker, which replays the answer the first
    stored in Redis: the same content and file ids, the file downloads from either
    worker, and the job ran once (stateful), or its random output is the same
    (stateless: nothing in a workspace counts it)."""
    one, two = workers
    hint = f"conv-{uuid.uuid4().hex[:8]}"
    key = uuid.uuid4().hex
    first = run(driver, one, key=key, hint=hint)
    assert first["content"].startswith("stdout:\n1\n"), first
    again = run(driver, two, key=key, hint=hint)
    assert (again["content"], again["artifact"]) == (first["content"], first["artifact"])
    assert downloaded(one, out_file(again)) == downloaded(two, out_file(again)) == b"run 1"
    ran_once(driver, two, hint)

    random = {"lang": "py", "code": "import os; print(os.urandom(8).hex())"}
    key = uuid.uuid4().hex
    answers = [driver.invoke(params=params(w, key), args=random) for w in (one, two)]
    assert answers[0]["ok"], answers[0]
    assert answers[1] == {**answers[0], "id": answers[1]["id"]}


def test_a_keyed_retry_after_a_wipe_runs_once_and_answers_the_same_files(
    workers: tuple[Serve, Serve], driver: Driver, private_redis: str
) -> None:
    """The keyed turn committed and answered, then Redis was wiped before the client saw
    the answer (the registry forgot the key's answer and the session): the retry, through
    the other worker, finds the turn saved in the store and answers the first run's
    answer, the same file ids, which still download, and the job ran once. Before, the
    LibreChat route saved nothing by key: the retry ran the job again (a 2, new files)."""
    one, two = workers
    hint = f"conv-{uuid.uuid4().hex[:8]}"
    key = uuid.uuid4().hex
    first = run(driver, one, key=key, hint=hint)
    assert first["content"].startswith("stdout:\n1\n"), first
    with redis.Redis.from_url(private_redis) as db:
        db.flushall()
    again = run(driver, two, key=key, hint=hint)
    assert (again["content"], again["artifact"]) == (first["content"], first["artifact"])
    assert downloaded(two, out_file(again)) == downloaded(one, out_file(again)) == b"run 1"
    # The answer is the registry's again: a third try is the same.
    third = run(driver, one, key=key, hint=hint)
    assert (third["content"], third["artifact"]) == (first["content"], first["artifact"])
    ran_once(driver, one, hint)


def test_a_keyed_run_whose_client_left_answers_its_retry_without_running_again(
    workers: tuple[Serve, Serve],
) -> None:
    """The client gives up on a keyed run before it answers (its own timeout) and
    retries through the other worker: the run was not cancelled by the client leaving,
    the retry waits it out (409 ``idempotency_in_flight`` meanwhile) and gets its
    answer, whose file downloads; the job ran once."""
    one, two = workers
    hint = f"conv-{uuid.uuid4().hex[:8]}"
    body = {
        "lang": "py",
        "code": "import time; time.sleep(2)\n" + COUNT,
        "user_id": "u1",
        "runtime_session_hint": hint,
    }
    key = {"Idempotency-Key": uuid.uuid4().hex}
    with one.client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/exec", json=body, headers=key, timeout=0.5)
    deadline = time.monotonic() + 120
    with two.client() as client:
        while (again := client.post("/exec", json=body, headers=key)).status_code == 409:
            assert again.json()["error"]["code"] == "idempotency_in_flight", again.text
            assert time.monotonic() < deadline, "the first run never finished"
            time.sleep(0.5)
        assert again.status_code == 200, again.text
        assert again.headers["idempotent-replayed"] == "true"
        answer = again.json()
        assert answer["stdout"] == "1\n", answer
        (out,) = [f for f in answer["files"] if f["name"] == "out.txt"]
        assert downloaded(one, out) == b"run 1"
        unkeyed = client.post("/exec", json=body | {"code": COUNT})
        assert unkeyed.json()["stdout"] == "2\n", unkeyed.text
