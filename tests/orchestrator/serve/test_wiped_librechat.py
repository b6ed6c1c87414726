"""A keyed LibreChat exec whose commit finds Redis wiped (issue 20), in-process so the
wipe lands exactly between the turn's checkpoint upload and the record write that
would commit it (``test_wiped_registry``'s injected registry).

The worker answers an error; the turn is applied in the store all the same. The
retry must find it there and answer what the first run would have: its stdout and
the output files it stored (the same ids, still downloadable), not run the job a
second time. The wipe after an answered commit is ``tests/librechat/test_exec_once``
(LibreChat's own client, two workers).
"""

from __future__ import annotations

import json
import uuid

import httpx

from tests.orchestrator.serve.test_wiped_registry import (
    AUTH,
    KEY,
    call,
    env,
    private_redis,
    ran_once,
    session,
    stdout_of,
    wipe,
    worker,
)

__all__ = ["env", "private_redis"]

LC = {"X-API-Key": KEY}
COUNT = (
    "open('runs', 'a').write('x\\n')\n"
    "n = len(open('runs').read().splitlines())\n"
    "open('/mnt/data/out.txt', 'w').write(f'run {n}')\n"
    "print(n)\n"
)


def exec_body(hint: str) -> bytes:
    call = {"lang": "py", "code": COUNT, "user_id": "u", "runtime_session_hint": hint}
    return json.dumps(call).encode()


async def exec_once(client: httpx.AsyncClient, hint: str, key: str | None) -> httpx.Response:
    headers = LC | ({"Idempotency-Key": key} if key else {})
    return await client.post("/librechat/v1/exec", content=exec_body(hint), headers=headers)


async def test_a_librechat_retry_after_a_wipe_before_the_commit_answers_the_first_runs_files(
    env: dict[str, str],
) -> None:
    """The first answers an error; its retry answers the first run's stdout and file,
    which downloads, and the job ran once."""
    key = uuid.uuid4().hex
    async with (
        worker(env, wipe_before_commit=True) as (client, injected),
        session(client) as hint,
    ):
        assert injected is not None
        first = await exec_once(client, hint, key)
        assert injected.wiped
        assert first.status_code != 200, first.text
        again = await exec_once(client, hint, key)
        assert again.status_code == 200, again.text
        answer = again.json()
        assert answer["stdout"] == "1\n", answer
        (out,) = [f for f in answer["files"] if f["name"] == "out.txt"]
        got = await client.get(
            f"/librechat/v1/download/{out['storage_session_id']}/{out['id']}", headers=LC
        )
        assert (got.status_code, got.content) == (200, b"run 1")
        # The registry has the answer again: the third try replays it byte for byte.
        third = await exec_once(client, hint, key)
        assert third.headers.get("idempotent-replayed") == "true", third.text
        assert third.content == again.content
        # The job ran once: the next run counts 2 (through /v1/exec, which then knows
        # the session as the tenant's and deletes it at the end).
        await ran_once(client, hint)


async def test_a_librechat_answer_found_after_a_wipe_is_saved_again_as_it_was(
    env: dict[str, str],
) -> None:
    """A retry that found the keyed turn after a wipe saves its result by key again; a
    later turn then writes a newer checkpoint, and Redis is wiped a second time: the
    next retry finds the answer by key alone, and it is still the first run's (the
    same bytes: stdout and file ids), not one built by the retry that ran nothing."""
    key = uuid.uuid4().hex
    async with worker(env) as (client, _), session(client) as hint:
        first = await exec_once(client, hint, key)
        assert first.status_code == 200, first.text
        await wipe(env["SANDCELL_REGISTRY_URL"])
        again = await exec_once(client, hint, key)
        assert again.content == first.content
        later = await exec_once(client, hint, None)
        assert later.json()["stdout"] == "2\n", later.text
        await wipe(env["SANDCELL_REGISTRY_URL"])
        third = await exec_once(client, hint, key)
        assert third.status_code == 200, third.text
        assert third.content == first.content
        # Run twice in all (the keyed one, the later one); through /v1/exec, which then
        # knows the session as the tenant's and deletes it at the end.
        counted = await client.post("/v1/exec", content=call(hint), headers=AUTH)
        assert stdout_of(counted) == "3\n"
