"""The code interpreter's ``POST /execute`` with an ``Idempotency-Key`` (issue 20): a
retry gets the first run's NDJSON answer byte for byte and the cell does not run again.

``e2b-code-interpreter``'s ``run_code`` sends no ``Idempotency-Key`` (its client has
no header option), so the keyed calls are httpx against the route, with the headers
the SDK sends; the SDK itself reads the context's state back (the cell ran once).
Each cell prints a fresh uuid4 and bumps a counter in the interpreter: a second run
would print another uuid and leave the counter at 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b_code_interpreter import Sandbox

from tests.e2b_api.conftest import KEY_B, E2bServe

# Counts its runs in the interpreter, prints a uuid nobody can guess twice.
CELL = "import uuid\nruns += 1\nprint(uuid.uuid4())"


@pytest.fixture
def sbx(e2b_serve: E2bServe) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(**e2b_serve.opts())
    try:
        assert sandbox.run_code("runs = 0").error is None
        yield sandbox
    finally:
        sandbox.kill()


def _client(served: E2bServe, sandbox: Sandbox) -> httpx.Client:
    headers = {
        "E2b-Sandbox-Id": sandbox.sandbox_id,
        "E2b-Sandbox-Port": "49999",
        "E2B-Traffic-Access-Token": sandbox.traffic_access_token or "",
    }
    return httpx.Client(base_url=f"{served.url}/e2b/sandbox", headers=headers, timeout=120)


def execute(
    served: E2bServe, sandbox: Sandbox, code: str = CELL, *, key: str | None, **fields: Any
) -> httpx.Response:
    """One ``/execute`` as the SDK posts it, with ``key`` as its ``Idempotency-Key``."""
    body = {"code": code, "context_id": None, "language": None, "env_vars": None, **fields}
    headers = {"Idempotency-Key": key} if key is not None else {}
    with _client(served, sandbox) as client:
        return client.post("/execute", json=body, headers=headers)


def stdout_of(answer: httpx.Response) -> str:
    lines = [json.loads(line) for line in answer.text.splitlines()]
    return "".join(line["text"] for line in lines if line["type"] == "stdout")


def let_go(served: E2bServe, marker: str) -> None:
    """Write ``go`` beside the file ``marker`` a waiting cell made in its workspace.

    Written on the host, into the workspace directory the jail mounts: while the
    cell runs the session is held, and the SDK's own file calls wait their turn."""
    # One workspace, maybe seen through two paths (an image and its mount).
    found = [path for path in served.runtime_dir.rglob(marker) if path.is_file()]
    assert found, marker
    (found[0].parent / "go").write_text("")


def waiting_cell(marker: str, then: str) -> str:
    """A cell that counts its run, says ``started``, waits for ``let_go`` and runs ``then``."""
    return (
        f"import os, time, uuid\nruns += 1\nopen({marker!r}, 'w').close()\n"
        "print('started', flush=True)\n"
        f"while not os.path.exists('go'):\n    time.sleep(0.02)\nos.remove('go')\n{then}"
    )


def runs(sandbox: Sandbox) -> str:
    """The counter, read with the SDK: how often a cell ran in the default context."""
    execution = sandbox.run_code("runs")
    assert execution.error is None, execution.error
    return str(execution.text)


def test_a_retry_gets_the_first_answer_byte_for_byte(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """Same key and body: the stored NDJSON, marked replayed; the cell ran once. The
    same cell without a key runs again."""
    first = execute(e2b_serve, sbx, key="cell-1")
    assert first.status_code == 200, first.text
    assert first.headers["content-type"].startswith("application/x-ndjson")
    assert "idempotent-replayed" not in first.headers
    again = execute(e2b_serve, sbx, key="cell-1")
    assert again.status_code == 200, again.text
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert len(stdout_of(first).strip()) == 36  # the uuid
    assert runs(sbx) == "1"
    unkeyed = execute(e2b_serve, sbx, key=None)
    assert stdout_of(unkeyed) != stdout_of(first)
    assert runs(sbx) == "2"


def test_the_same_key_with_another_body_is_refused(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """422 ``idempotency_key_reused``, in E2B's error body; nothing runs."""
    assert execute(e2b_serve, sbx, key="cell-2").status_code == 200
    other = execute(e2b_serve, sbx, CELL + "\nprint('other')", key="cell-2")
    assert other.status_code == 422, other.text
    assert other.json()["error_code"] == "idempotency_key_reused"
    assert runs(sbx) == "1"


def test_a_retry_while_the_first_runs_is_told_to_wait(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """409 ``idempotency_in_flight`` with ``Retry-After`` while the first call's cell runs;
    once it ended, the retry gets its answer."""
    cell = waiting_cell("waiting-cell-3", "print(uuid.uuid4())")
    body = {"code": cell, "context_id": None, "language": None, "env_vars": None}
    keyed = {"Idempotency-Key": "cell-3"}
    with (
        _client(e2b_serve, sbx) as client,
        client.stream("POST", "/execute", json=body, headers=keyed) as first,
    ):
        lines = first.iter_lines()
        started = next(lines)
        assert json.loads(started)["text"] == "started\n"
        waiting = execute(e2b_serve, sbx, cell, key="cell-3")
        assert waiting.status_code == 409, waiting.text
        assert waiting.json()["error_code"] == "idempotency_in_flight"
        assert waiting.headers["retry-after"] == "1"
        let_go(e2b_serve, "waiting-cell-3")
        rest = list(lines)
    again = execute(e2b_serve, sbx, cell, key="cell-3")
    assert again.headers["idempotent-replayed"] == "true"
    assert again.text.splitlines() == [started, *rest]
    assert runs(sbx) == "1"


def test_a_keyed_cell_outlives_its_caller(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """The caller leaves mid-cell: the cell runs to its end, and the retry gets its
    answer instead of running it again."""
    cell = waiting_cell("waiting-cell-4", "print('finished')")
    body = {"code": cell, "context_id": None, "language": None, "env_vars": None}
    keyed = {"Idempotency-Key": "cell-4"}
    with (
        _client(e2b_serve, sbx) as client,
        client.stream("POST", "/execute", json=body, headers=keyed) as first,
    ):
        assert json.loads(next(first.iter_lines()))["text"] == "started\n"
    # The caller is gone; let the cell finish, then retry until it has ended.
    let_go(e2b_serve, "waiting-cell-4")
    for _ in range(600):
        again = execute(e2b_serve, sbx, cell, key="cell-4")
        if again.status_code != 409:
            break
    assert again.status_code == 200, again.text
    assert again.headers["idempotent-replayed"] == "true"
    assert stdout_of(again) == "started\nfinished\n"
    assert runs(sbx) == "1"


def test_an_error_answer_frees_the_key(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """A refused call (404, no such context) is not kept: the key then runs another
    body, whose answer it keeps."""
    missing = execute(e2b_serve, sbx, key="cell-5", context_id="nosuchcontext")
    assert missing.status_code == 404, missing.text
    assert missing.json()["error_code"] == "not_found"
    first = execute(e2b_serve, sbx, key="cell-5")
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    again = execute(e2b_serve, sbx, key="cell-5")
    assert again.content == first.content
    assert runs(sbx) == "1"


def test_keys_are_the_sandboxs_own(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """Another sandbox (another tenant's, or the same tenant's) with the same key and
    body runs its own cell; each retry gets its own sandbox's answer."""
    theirs = Sandbox.create(**e2b_serve.opts(KEY_B))
    mine_too = Sandbox.create(**e2b_serve.opts())
    try:
        for other in (theirs, mine_too):
            assert other.run_code("runs = 0").error is None
        answers = {
            name: execute(e2b_serve, sandbox, key="cell-6")
            for name, sandbox in (("a", sbx), ("b", theirs), ("a2", mine_too))
        }
        assert len({stdout_of(answer) for answer in answers.values()}) == 3
        for name, sandbox in (("a", sbx), ("b", theirs), ("a2", mine_too)):
            again = execute(e2b_serve, sandbox, key="cell-6")
            assert again.content == answers[name].content
            assert runs(sandbox) == "1"
    finally:
        theirs.kill()
        mine_too.kill()
