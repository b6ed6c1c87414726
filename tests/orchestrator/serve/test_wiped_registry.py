"""A keyed turn survives a Redis that forgot everything (issue 20: persistence off, wiped).

The registry holds a keyed turn's answer, and the record pointing at its checkpoint; a
wiped Redis loses both. A retry with the same key then holds a session with no record,
restores the newest checkpoint object (the store's own account, generations never going
backwards) and, before this was fixed, ran the job again on a workspace that already
held its first run: the turn applied twice. The checkpoint object now carries the
result of the keyed turn that wrote it, and the retry gets that result instead.

Two wipes: after the turn committed and answered (the client never saw the answer),
and between the checkpoint upload and the record write that would have committed it
(the worker answers an error, and the retry finds the turn applied anyway). Real
redis-server (a private one: the wipe is a FLUSHALL), real runners, the directory
store and moto's S3.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio

from sandcell_orchestrator.bootstrap import open_services
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.registry import IdempotentAnswer, Lease, SessionRecord, SessionRegistry
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.snapshots import SnapshotInfo, SnapshotStore, SnapshotUnavailableError
from sandcell_orchestrator.testing import clean_environ
from sandcell_protocol import ExecuteResult, decode, runtime_session_id
from tests.fixtures.private_redis import private_redis_server
from tests.orchestrator.apps.http_server import serve_asgi
from tests.orchestrator.conftest import S3Server
from tests.orchestrator.serve.fleet import fleet_env

KEY = "wipe-key-0123456789abcdef"
KEY_B = "wipe-key-b-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
# Each run appends a line and prints how many there are: a second run shows as a 2.
COUNT = "open('runs', 'a').write('x\\n'); print(len(open('runs').read().splitlines()))"


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own, without persistence: a FLUSHALL wipes only it."""
    with private_redis_server(tmp_path) as server:
        yield server.url


async def wipe(url: str) -> None:
    async with redis.asyncio.Redis.from_url(url) as db:
        await db.flushall()


class _WipedBeforeCommit:
    """The manager's registry: the first write that would commit a keyed turn (the one
    carrying its answer) finds Redis wiped, after the turn's checkpoint was uploaded."""

    def __init__(self, inner: SessionRegistry, url: str) -> None:
        self._inner = inner
        self._url = url
        self.wiped = False
        self.persistence: Any = None
        """The worker's checkpoint persistence (a test swaps its store)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def put(
        self, lease: Lease, record: SessionRecord, *, answer: IdempotentAnswer | None = None
    ) -> None:
        if answer is not None and not self.wiped:
            self.wiped = True
            await wipe(self._url)
        await self._inner.put(lease, record, answer=answer)


@pytest.fixture(params=["directory", "s3"])
def env(
    request: pytest.FixtureRequest, tmp_path: Path, runtime_dir: Path, private_redis: str
) -> dict[str, str]:
    settings = {
        "SANDCELL_HOME": str(tmp_path / "home"),
        "SANDCELL_LOCAL_RUNTIME_DIR": str(runtime_dir),
        "SANDCELL_API_KEYS": f"{KEY}=tenant-a,{KEY_B}=tenant-b",
        "SANDCELL_REGISTRY_URL": private_redis,
    }
    if request.param == "s3":
        s3: S3Server = request.getfixturevalue("s3_server")
        settings |= fleet_env(private_redis, s3, prefix="wiped")
    return settings


@asynccontextmanager
async def worker(
    env: dict[str, str], *, wipe_before_commit: bool = False
) -> AsyncIterator[tuple[httpx.AsyncClient, _WipedBeforeCommit | None]]:
    settings = OrchestratorSettings.from_env(clean_environ(**env))
    async with open_services(settings) as services:
        injected = None
        if wipe_before_commit:
            injected = _WipedBeforeCommit(services.manager.registry, env["SANDCELL_REGISTRY_URL"])
            services.manager.registry = injected  # type: ignore[assignment]
            injected.persistence = services.manager.persistence
        async with (
            serve_asgi(create_app(settings, services=services), lifespan="on") as url,
            httpx.AsyncClient(base_url=url, timeout=120) as client,
        ):
            yield client, injected


def call(hint: str, code: str = COUNT) -> bytes:
    body = {"language": "python", "user_id": "u", "runtime_session_hint": hint, "code": code}
    return json.dumps(body).encode()


def stdout_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return decode(response.content, ExecuteResult).stdout


def result_of(response: httpx.Response, *, stream: bool) -> ExecuteResult:
    """The answer's result: the body, or the NDJSON stream's last (result) event."""
    assert response.status_code == 200, response.text
    if not stream:
        return decode(response.content, ExecuteResult)
    event = json.loads(response.content.splitlines()[-1])
    return decode(json.dumps(event["result"]).encode(), ExecuteResult)


async def ran_once(client: httpx.AsyncClient, hint: str) -> None:
    """The job ran exactly once before: the next unkeyed turn counts 2."""
    assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == "2\n"


async def retry_gets_the_first_run(
    client: httpx.AsyncClient,
    hint: str,
    key: str,
    *,
    code: bytes | None = None,
    printed: str = "1\n",
) -> None:
    """The keyed retry answers the first run's output, durable, and ran nothing again."""
    again = await client.post(
        "/v1/exec", content=code or call(hint), headers=AUTH | {"Idempotency-Key": key}
    )
    result = result_of(again, stream=False)
    assert (result.stdout, result.durable) == (printed, True)
    await ran_once(client, hint)


@asynccontextmanager
async def session(
    client: httpx.AsyncClient, *, hint: str | None = None, tenant: str = "tenant-a"
) -> AsyncIterator[str]:
    """A session hint; the session is deleted at the end, as a client would (with Redis
    its sandbox outlives the worker's services)."""
    hint = hint or f"h-{uuid.uuid4().hex[:8]}"
    try:
        yield hint
    finally:
        session_id = runtime_session_id(tenant, "u", hint)
        auth = AUTH if tenant == "tenant-a" else AUTH_B
        deleted = await client.delete(f"/v1/sessions/{session_id}", headers=auth)
        assert deleted.status_code == 204, deleted.text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_retry_after_a_wipe_gets_the_committed_turns_result(
    env: dict[str, str], stream: bool
) -> None:
    """The keyed turn committed and answered; Redis is wiped (its answer and the record
    gone) and the client, which never saw the answer, retries: it gets the first run's
    result (durable), and the job ran once."""
    key = uuid.uuid4().hex
    more = {"Accept": "application/x-ndjson"} if stream else {}
    async with worker(env) as (client, _), session(client) as hint:
        first = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert stdout_of(first) == "1\n"
        await wipe(env["SANDCELL_REGISTRY_URL"])
        again = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | more | {"Idempotency-Key": key}
        )
        result = result_of(again, stream=stream)
        assert (result.stdout, result.durable) == ("1\n", True)
        # The answer is the registry's again: a third try replays it from there.
        third = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert third.headers.get("idempotent-replayed") == "true", third.text
        assert stdout_of(third) == "1\n"
        await ran_once(client, hint)


async def test_a_retry_after_a_wipe_before_the_commit_finds_the_turn_applied(
    env: dict[str, str],
) -> None:
    """Redis is wiped between the keyed turn's checkpoint upload and the record write
    that commits it: the worker answers an error (its lock is gone); the retry restores
    that newest checkpoint, which already holds the turn, and gets its result instead of
    running it a second time."""
    key = uuid.uuid4().hex
    async with (
        worker(env, wipe_before_commit=True) as (client, injected),
        session(client) as hint,
    ):
        assert injected is not None
        first = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert injected.wiped
        assert first.status_code != 200, first.text
        again = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        result = decode(again.content, ExecuteResult) if again.status_code == 200 else None
        assert result is not None, again.text
        assert (result.stdout, result.durable) == ("1\n", True)
        await ran_once(client, hint)


class _ResultPutFails:
    """The snapshot store, as the S3 endpoint blinks just as a keyed turn saves its
    result, while Redis is wiped: that one put fails."""

    def __init__(self, inner: SnapshotStore, url: str) -> None:
        self._inner = inner
        self._url = url
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def put(self, key: str, stream: AsyncIterable[bytes], *, max_bytes: int) -> SnapshotInfo:
        if ".turn-" in key and not self.failed:
            self.failed = True
            await wipe(self._url)
            raise SnapshotUnavailableError("injected: S3 blinked")
        return await self._inner.put(key, stream, max_bytes=max_bytes)


async def test_no_checkpoint_of_a_keyed_turn_is_stored_without_its_result(
    env: dict[str, str],
) -> None:
    """The result of a keyed turn is saved before its checkpoint, so a checkpoint that
    holds the turn always says so: here the result's put fails as Redis is wiped, the
    turn's checkpoint retry lands under a low generation (the counter went with the
    wipe) and its commit is refused; the retry finds the turn applied where it was
    saved, and the job ran once (a checkpoint saved first, without its result, was
    the newest object and the retry ran the job again)."""
    key = uuid.uuid4().hex
    settings = OrchestratorSettings.from_env(clean_environ(**env))
    async with open_services(settings) as services:
        persistence = services.manager.persistence
        failing = _ResultPutFails(persistence.store, env["SANDCELL_REGISTRY_URL"])
        persistence.store = failing  # type: ignore[assignment]
        async with (
            serve_asgi(create_app(settings, services=services), lifespan="on") as url,
            httpx.AsyncClient(base_url=url, timeout=120) as client,
            session(client) as hint,
        ):
            assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == (
                "1\n"
            )
            first = await client.post(
                "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
            )
            assert failing.failed
            assert first.status_code != 200, first.text
            again = await client.post(
                "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
            )
            result = result_of(again, stream=False)
            assert (result.stdout, result.durable) == ("2\n", True)
            assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == (
                "3\n"
            )


# Changes nothing in the workspace; a second run would print another value.
UNCHANGED = "import uuid; print(uuid.uuid4().hex)"


async def test_a_retry_after_a_wipe_finds_the_turn_behind_a_later_checkpoint(
    env: dict[str, str],
) -> None:
    """The keyed turn committed, then another turn wrote a newer checkpoint (as an idle
    suspend does), then Redis was wiped: the retry restores that newer checkpoint, not
    the one the turn wrote, and still gets the first run's result by its key (before,
    only the newest checkpoint's own result was looked at: the job ran again)."""
    key = uuid.uuid4().hex
    async with worker(env) as (client, _), session(client) as hint:
        first = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert stdout_of(first) == "1\n"
        later = call(hint, "open('other', 'a').write('y')")
        assert (await client.post("/v1/exec", content=later, headers=AUTH)).status_code == 200
        await wipe(env["SANDCELL_REGISTRY_URL"])
        await retry_gets_the_first_run(client, hint, key)


async def test_a_retry_after_a_wipe_gets_the_answer_of_a_turn_that_changed_nothing(
    env: dict[str, str],
) -> None:
    """A keyed turn that changed nothing writes no checkpoint; its answer is still kept
    by key in the store, so its retry after a wipe gets the same output, not a new run."""
    key = uuid.uuid4().hex
    async with worker(env) as (client, _), session(client) as hint:
        assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == "1\n"
        unchanged = call(hint, UNCHANGED)
        first = await client.post(
            "/v1/exec", content=unchanged, headers=AUTH | {"Idempotency-Key": key}
        )
        printed = stdout_of(first)
        await wipe(env["SANDCELL_REGISTRY_URL"])
        await retry_gets_the_first_run(client, hint, key, code=unchanged, printed=printed)


async def test_a_saved_answer_stays_with_its_tenant(env: dict[str, str]) -> None:
    """Tenant b sends the same Idempotency-Key, user and hint as tenant a's committed
    turn, after a wipe: its own session, its own key, so its job runs (it never gets
    tenant a's answer), and tenant a's retry still gets its own."""
    key = uuid.uuid4().hex
    async with (
        worker(env) as (client, _),
        session(client) as hint,
        session(client, hint=hint, tenant="tenant-b"),
    ):
        first = await client.post(
            "/v1/exec", content=call(hint, UNCHANGED), headers=AUTH | {"Idempotency-Key": key}
        )
        printed = stdout_of(first)
        await wipe(env["SANDCELL_REGISTRY_URL"])
        other = await client.post(
            "/v1/exec", content=call(hint, UNCHANGED), headers=AUTH_B | {"Idempotency-Key": key}
        )
        assert stdout_of(other) != printed
        assert other.headers.get("idempotent-replayed") is None
        again = await client.post(
            "/v1/exec", content=call(hint, UNCHANGED), headers=AUTH | {"Idempotency-Key": key}
        )
        assert stdout_of(again) == printed


class _ResultGetBlinks:
    """The snapshot store, as the S3 endpoint blinks once just as a retry reads a keyed
    turn's saved result (after that retry recorded the sandbox it restored)."""

    def __init__(self, inner: SnapshotStore) -> None:
        self._inner = inner
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get(self, key: str, *, max_bytes: int) -> Any:
        if ".turn-" in key and not self.failed:
            self.failed = True
            raise SnapshotUnavailableError("injected: S3 blinked")
        return self._inner.get(key, max_bytes=max_bytes)


async def test_a_retry_after_a_failed_retry_finds_the_turn_in_the_recorded_checkpoint(
    env: dict[str, str],
) -> None:
    """Redis is wiped before the keyed turn's commit; its first retry restores the
    turn's checkpoint and records that sandbox, then cannot read the saved result (a
    store blink: a retryable error, the job not run). The next retry finds that young
    record, not an empty registry, and must still find the turn applied in the
    checkpoint the record points at (it used to run the job again on it)."""
    key = uuid.uuid4().hex
    async with (
        worker(env, wipe_before_commit=True) as (client, injected),
        session(client) as hint,
    ):
        assert injected is not None
        persistence = injected.persistence
        blinking = _ResultGetBlinks(persistence.store)
        persistence.store = blinking  # type: ignore[assignment]
        first = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert injected.wiped
        assert first.status_code != 200, first.text
        failed = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert blinking.failed
        assert failed.status_code == 503, failed.text
        await retry_gets_the_first_run(client, hint, key)


async def test_a_retry_whose_launch_outlasts_the_young_record_window_finds_the_turn(
    env: dict[str, str],
) -> None:
    """After a wipe the retry's hold finds no record; its launch records the sandbox it
    restores into, and a launch and restore can take longer than the young-record
    window (here the window is 0: a collection grace period of 0). Whether the registry
    may have forgotten is judged by the record the hold found, so the retry still gets
    the first run's result (it used to judge after the launch and run the job again)."""
    key = uuid.uuid4().hex
    async with (
        worker(env | {"SANDCELL_CHECKPOINT_GRACE_S": "0"}) as (client, _),
        session(client) as hint,
    ):
        first = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert stdout_of(first) == "1\n"
        await wipe(env["SANDCELL_REGISTRY_URL"])
        await retry_gets_the_first_run(client, hint, key)


class _RestoreGetBlinks:
    """The snapshot store, as the S3 endpoint blinks once just as a retry reads the
    checkpoint it restores (after that retry recorded the sandbox it launched)."""

    def __init__(self, inner: SnapshotStore) -> None:
        self._inner = inner
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get(self, key: str, *, max_bytes: int) -> Any:
        if ".turn-" not in key and "/answer-" not in key and not self.failed:
            self.failed = True
            raise SnapshotUnavailableError("injected: S3 blinked")
        return self._inner.get(key, max_bytes=max_bytes)


async def test_a_retry_past_the_young_record_window_finds_the_turn_it_restores(
    env: dict[str, str],
) -> None:
    """Redis is wiped before the keyed turn's commit. The first retry finds no record,
    lists the store and records a sandbox for the newest checkpoint, the turn's own, but
    its restore fails (a store blink: retryable, the job not run). The next retry comes
    after the young-record window (here 0), as one does after a long outage: the record
    looks old, yet it was made after the wipe and points at the turn's own checkpoint.
    A retry that restores a checkpoint reads that checkpoint's saved result, so it
    gets the first run's result (it used to run the job again on top of it)."""
    key = uuid.uuid4().hex
    async with (
        worker(env | {"SANDCELL_CHECKPOINT_GRACE_S": "0"}, wipe_before_commit=True) as (
            client,
            injected,
        ),
        session(client) as hint,
    ):
        assert injected is not None
        first = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert injected.wiped
        assert first.status_code != 200, first.text
        persistence = injected.persistence
        blinking = _RestoreGetBlinks(persistence.store)
        persistence.store = blinking  # type: ignore[assignment]
        failed = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert blinking.failed
        assert failed.status_code == 503, failed.text
        await retry_gets_the_first_run(client, hint, key)


async def test_a_late_retry_after_a_failed_retry_still_finds_the_turn(
    env: dict[str, str],
) -> None:
    """As above, but the next retry comes after the young-record window (here 0): the
    record the failed retry made points at a checkpoint taken from the store's listing,
    so the registry holds no answer of the turns up to it, however old the record is.
    The retry still looks in the store and finds the turn applied (it used to judge the
    record old, ran the job again: the duplicates of the chaos runs after a wipe)."""
    key = uuid.uuid4().hex
    async with (
        worker(env | {"SANDCELL_CHECKPOINT_GRACE_S": "0"}, wipe_before_commit=True) as (
            client,
            injected,
        ),
        session(client) as hint,
    ):
        assert injected is not None
        persistence = injected.persistence
        blinking = _ResultGetBlinks(persistence.store)
        persistence.store = blinking  # type: ignore[assignment]
        first = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert injected.wiped
        assert first.status_code != 200, first.text
        failed = await client.post(
            "/v1/exec", content=call(hint), headers=AUTH | {"Idempotency-Key": key}
        )
        assert blinking.failed
        assert failed.status_code == 503, failed.text
        await retry_gets_the_first_run(client, hint, key)
