"""Two ``sandcell serve`` workers on one real redis-server and one S3 (moto's server),
as docs/deployment.md deploys them (issue 20): a session started on one continues on
the other, either is listed and deleted through either, and ``Idempotency-Key``
retries get the first run's answer and never run again, whichever worker they reach."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import psutil
import pytest
import redis.asyncio

from sandcell_orchestrator.serve.idempotency import Idempotency
from sandcell_orchestrator.testing import sandbox_processes
from sandcell_protocol import ErrorBody, ErrorCode, ExecuteResult, decode, runtime_session_id
from tests.librechat.conftest import KEY_A, KEY_B, Serve, running_serve
from tests.orchestrator.conftest import redis_url, running_s3
from tests.orchestrator.serve.fleet import fleet_env

__all__ = ["redis_url"]

# Each run appends a line and prints how many there are: a second run shows as a 2.
COUNT = "open('runs', 'a').write('x\\n'); print(len(open('runs').read().splitlines()))"


@pytest.fixture(scope="module")
def workers(redis_url: str) -> Iterator[tuple[Serve, Serve]]:
    with running_s3() as s3:
        env = fleet_env(redis_url, s3, prefix="idem")
        with running_serve("idem-w1-", **env) as one, running_serve("idem-w2-", **env) as two:
            yield one, two


@pytest.fixture
async def clients(workers: tuple[Serve, Serve]) -> AsyncIterator[tuple[httpx.AsyncClient, ...]]:
    async with (
        httpx.AsyncClient(base_url=workers[0].url, timeout=120) as one,
        httpx.AsyncClient(base_url=workers[1].url, timeout=120) as two,
    ):
        yield one, two


def headers(key: str | None, tenant: str = KEY_A, **more: str) -> dict[str, str]:
    found = {"Authorization": f"Bearer {tenant}", **more}
    if key is not None:
        found["Idempotency-Key"] = key
    return found


def call(hint: str, code: str = COUNT) -> bytes:
    body = {"language": "python", "user_id": "u", "runtime_session_hint": hint, "code": code}
    return json.dumps(body).encode()


def stdout_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return decode(response.content, ExecuteResult).stdout


def code_of(response: httpx.Response) -> ErrorCode:
    return decode(response.content, ErrorBody).error.code


async def test_a_retry_gets_the_first_answer_on_either_worker(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    """Same key and body: the first answer byte for byte (JSON or NDJSON), on the other
    worker too, and the job ran once: the next unkeyed turn counts 2."""
    one, two = clients
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    first = await one.post("/v1/exec", content=call(hint), headers=headers(key))
    assert stdout_of(first) == "1\n"
    assert "idempotent-replayed" not in first.headers
    again = await two.post("/v1/exec", content=call(hint), headers=headers(key))
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    streamed = await one.post(
        "/v1/exec", content=call(hint), headers=headers(key, Accept="application/x-ndjson")
    )
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert [line["type"] for line in lines] == ["result"]
    assert lines[0]["result"]["stdout"] == "1\n"
    assert stdout_of(await two.post("/v1/exec", content=call(hint), headers=headers(None))) == (
        "2\n"
    )


async def test_a_streamed_first_run_is_kept_too(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    """A keyed NDJSON turn stores its result; the JSON retry gets it without a run."""
    one, two = clients
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    streamed = await one.post(
        "/v1/exec", content=call(hint), headers=headers(key, Accept="application/x-ndjson")
    )
    assert json.loads(streamed.text.splitlines()[-1])["result"]["stdout"] == "1\n"
    assert stdout_of(await two.post("/v1/exec", content=call(hint), headers=headers(key))) == "1\n"


async def test_same_key_other_body_is_422(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    """A key names one request: another body under it is refused with a machine code."""
    one, two = clients
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    assert stdout_of(await one.post("/v1/exec", content=call(hint), headers=headers(key))) == "1\n"
    other = await two.post("/v1/exec", content=call(hint, "print('other')"), headers=headers(key))
    assert other.status_code == 422
    assert code_of(other) == ErrorCode.IDEMPOTENCY_KEY_REUSED


async def test_keys_are_scoped_to_the_tenant(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    """Another tenant's equal key and body run on their own: nothing of tenant A's comes back."""
    one, _ = clients
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    assert stdout_of(await one.post("/v1/exec", content=call(hint), headers=headers(key))) == "1\n"
    theirs = await one.post("/v1/exec", content=call(hint), headers=headers(key, tenant=KEY_B))
    assert stdout_of(theirs) == "1\n"
    assert "idempotent-replayed" not in theirs.headers


async def test_an_answer_a_newer_worker_stored_replays_here(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], redis_url: str
) -> None:
    """During a rolling upgrade a retry reaches a worker older than the one that ran the
    call: the stored answer, with a field this worker does not know, still replays, as
    JSON (as stored) and as NDJSON (re-encoded here), and the job does not run again."""
    one, two = clients
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    assert stdout_of(await one.post("/v1/exec", content=call(hint), headers=headers(key))) == "1\n"
    stored = f"sandcell:idem:{Idempotency.scoped('v1/exec', 'tenant-a', key)}"
    async with redis.asyncio.Redis.from_url(redis_url) as db:
        body = json.loads(await db.hget(stored, "body"))
        newer = {**body, "written_by": "a newer worker", "files": body["files"]}
        await db.hset(stored, "body", json.dumps(newer))
    again = await two.post("/v1/exec", content=call(hint), headers=headers(key))
    assert json.loads(again.content)["written_by"] == "a newer worker"
    streamed = await two.post(
        "/v1/exec", content=call(hint), headers=headers(key, Accept="application/x-ndjson")
    )
    assert streamed.status_code == 200, streamed.text
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert [(line["type"], line["result"]["stdout"]) for line in lines] == [("result", "1\n")]
    assert streamed.headers["idempotent-replayed"] == "true"
    assert stdout_of(await one.post("/v1/exec", content=call(hint), headers=headers(None))) == (
        "2\n"
    )


async def test_a_retry_in_flight_is_409_and_an_error_is_not_kept(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], redis_url: str
) -> None:
    """While the first run works, its retry is 409 idempotency_in_flight with Retry-After;
    a keyed call that failed (here: its session was busy) is forgotten, so its key is free."""
    one, two = clients
    hint, key, other_key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, uuid.uuid4().hex
    slow = call(hint, "import time; time.sleep(4); print('slow')")
    first = asyncio.ensure_future(one.post("/v1/exec", content=slow, headers=headers(key)))
    # Retry only once the first holds its key (else the retry would be the first).
    stored = f"sandcell:idem:{Idempotency.scoped('v1/exec', 'tenant-a', key)}"
    async with redis.asyncio.Redis.from_url(redis_url) as db:
        for _ in range(600):
            if await db.exists(stored) or first.done():
                break
            await asyncio.sleep(0.05)
    retry = await two.post("/v1/exec", content=slow, headers=headers(key))
    assert retry.status_code == 409, retry.text
    assert code_of(retry) == ErrorCode.IDEMPOTENCY_IN_FLIGHT
    assert retry.headers["retry-after"] == "1"
    busy = await two.post("/v1/exec", content=call(hint), headers=headers(other_key))
    assert busy.status_code == 409
    assert code_of(busy) == ErrorCode.SESSION_BUSY
    assert stdout_of(await first) == "slow\n"
    replay = await two.post("/v1/exec", content=slow, headers=headers(key))
    assert stdout_of(replay) == "slow\n"
    assert replay.headers["idempotent-replayed"] == "true"
    # The busy call was not kept: its key takes a new body and runs it (once).
    assert stdout_of(
        await one.post("/v1/exec", content=call(hint), headers=headers(other_key))
    ) == ("1\n")


async def read_all(
    client: httpx.AsyncClient, body: bytes, sent: dict[str, str], *, timeout_s: float
) -> None:
    """POST to /v1/exec and read the whole answer, within ``timeout_s`` per read."""
    async with client.stream(
        "POST", "/v1/exec", content=body, headers=sent, timeout=timeout_s
    ) as response:
        async for _ in response.aiter_raw():
            pass


@pytest.mark.parametrize("stream", [False, True])
async def test_a_keyed_turn_outlives_its_caller(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], stream: bool
) -> None:
    """A keyed caller that gives up mid-turn (its read timed out) does not cancel the
    turn: it runs to its end, the retry through the other worker gets its answer, and
    the job ran once (a cancelled turn would keep its write and the retry run it again)."""
    one, two = clients
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    slow = call(
        hint,
        "import time\nopen('runs', 'a').write('x\\n')\nprint('wrote', flush=True)\n"
        "time.sleep(3)\nprint(len(open('runs').read().splitlines()))",
    )
    more = {"Accept": "application/x-ndjson"} if stream else {}
    with pytest.raises(httpx.ReadTimeout):
        await read_all(one, slow, headers(key, **more), timeout_s=1.0)
    while True:
        retry = await two.post("/v1/exec", content=slow, headers=headers(key))
        if retry.status_code != 409:
            break
        assert code_of(retry) == ErrorCode.IDEMPOTENCY_IN_FLIGHT
        await asyncio.sleep(0.2)
    assert stdout_of(retry) == "wrote\n1\n"
    assert retry.headers["idempotent-replayed"] == "true"
    assert stdout_of(await one.post("/v1/exec", content=call(hint), headers=headers(None))) == (
        "2\n"
    )


@pytest.mark.parametrize("key", ["", "a b", "x" * 256, "é"])
async def test_a_malformed_key_is_400(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], key: str
) -> None:
    """A key must be 1-255 printable ASCII characters."""
    one, _ = clients
    sent = {"Authorization": f"Bearer {KEY_A}".encode(), "Idempotency-Key": key.encode()}
    response = await one.post("/v1/exec", content=call("h-bad"), headers=sent)
    assert response.status_code == 400
    assert code_of(response) == ErrorCode.BAD_REQUEST


async def test_run_and_librechat_exec_take_keys(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    """``/v1/run`` and LibreChat's ``/exec`` replay the first answer on the other worker."""
    one, two = clients
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    run = json.dumps(
        {"language": "python", "user_id": "u", "runtime_session_hint": hint, "code": COUNT}
    )
    first = await one.post("/v1/run", content=run, headers=headers(key))
    assert first.status_code == 200, first.text
    again = await two.post("/v1/run", content=run, headers=headers(key))
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"

    lc = json.dumps({"lang": "py", "code": COUNT, "user_id": "u"})
    lc_headers = {"X-API-Key": KEY_A, "Idempotency-Key": key, "Content-Type": "application/json"}
    first = await one.post("/librechat/v1/exec", content=lc, headers=lc_headers)
    assert first.status_code == 200, first.text
    again = await two.post("/librechat/v1/exec", content=lc, headers=lc_headers)
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"


def session_of(hint: str, namespace: str = "tenant-a") -> str:
    return runtime_session_id(namespace, "u", hint)


async def listed(client: httpx.AsyncClient, tenant: str = KEY_A) -> list[str]:
    response = await client.get("/v1/sessions", headers=headers(None, tenant))
    assert response.status_code == 200, response.text
    return [s["session_id"] for s in response.json()["sessions"]]


async def test_a_session_continues_on_the_other_worker_and_is_listed_on_both(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    """Turns alternate workers on one session and each sees every earlier turn; both
    workers list it for its tenant only; a delete through one is seen by the other."""
    one, two = clients
    hint = f"h-{uuid.uuid4().hex[:8]}"
    for n, client in enumerate([one, two, one, two], start=1):
        assert (
            stdout_of(await client.post("/v1/exec", content=call(hint), headers=headers(None)))
            == f"{n}\n"
        )
    sid = session_of(hint)
    assert sid in await listed(one)
    assert sid in await listed(two)
    assert sid not in await listed(one, KEY_B)
    other_tenant = await one.delete(f"/v1/sessions/{sid}", headers=headers(None, KEY_B))
    assert other_tenant.status_code == 404
    deleted = await two.delete(f"/v1/sessions/{sid}", headers=headers(None))
    assert deleted.status_code == 204, deleted.text
    assert sid not in await listed(one)
    gone = await one.delete(f"/v1/sessions/{sid}", headers=headers(None))
    assert gone.status_code == 404
    # Deleted means deleted on every worker: the next turn starts from nothing.
    assert stdout_of(await one.post("/v1/exec", content=call(hint), headers=headers(None))) == "1\n"


async def test_a_turn_recovers_from_the_checkpoint_when_the_runner_is_gone(
    workers: tuple[Serve, Serve], clients: tuple[httpx.AsyncClient, httpx.AsyncClient]
) -> None:
    """Worker 1's runner for the session is SIGKILLed; worker 2's next turn restores the
    session from its checkpoint in S3 and sees every acknowledged turn."""
    one, two = clients
    hint = f"h-{uuid.uuid4().hex[:8]}"
    for n in (1, 2):
        assert (
            stdout_of(await one.post("/v1/exec", content=call(hint), headers=headers(None)))
            == f"{n}\n"
        )
    # The worker's own environment names its runtime directory too: spare it.
    worker = workers[0].process.pid
    killed = [p for p in sandbox_processes(workers[0].home.parent / "sandboxes") if p.pid != worker]
    assert killed, "worker 1 keeps no runner for the session"
    for process in killed:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(killed, timeout=10)
    assert stdout_of(await two.post("/v1/exec", content=call(hint), headers=headers(None))) == "3\n"
    assert stdout_of(await one.post("/v1/exec", content=call(hint), headers=headers(None))) == "4\n"


async def test_a_killed_workers_lock_lasts_its_ttl_not_its_turn(redis_url: str) -> None:
    """Worker 1 is SIGKILLed while it holds a session for a long turn (the execute budget
    is the default 300 s): the lock it leaves behind expires within SANDCELL_LOCK_TTL_S
    (default 15 s), not the turn's budgets, and worker 2 then serves the session."""
    with running_s3() as s3:
        env = fleet_env(redis_url, s3, prefix="lock")
        with running_serve("lock-w1-", **env) as one, running_serve("lock-w2-", **env) as two:
            hint = f"h-{uuid.uuid4().hex[:8]}"
            async with (
                httpx.AsyncClient(base_url=one.url, timeout=120) as first,
                httpx.AsyncClient(base_url=two.url, timeout=120) as second,
            ):
                answer = await first.post("/v1/exec", content=call(hint), headers=headers(None))
                assert stdout_of(answer) == "1\n"
                slow = call(hint, "import time; time.sleep(120)")
                stuck = asyncio.ensure_future(
                    first.post("/v1/exec", content=slow, headers=headers(None))
                )
                lock = f"sandcell:lock:{session_of(hint)}"
                async with redis.asyncio.Redis.from_url(redis_url) as db:
                    while not await db.exists(lock):
                        await asyncio.sleep(0.05)
                    one.process.send_signal(signal.SIGKILL)
                    one.process.wait()
                    with contextlib.suppress(httpx.HTTPError):
                        await stuck
                    left_ms = await db.pttl(lock)
                    assert 0 < left_ms <= 15_000, left_ms
                    while await db.exists(lock):
                        await asyncio.sleep(0.2)
                answer = await second.post("/v1/exec", content=call(hint), headers=headers(None))
                # The killed turn never checkpointed: the session is as turn 1 left it.
                assert stdout_of(answer) == "2\n"
