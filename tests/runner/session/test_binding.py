"""Session binding, multi-turn state, pinned UID, conflicts, busy, release and quarantine."""

from __future__ import annotations

import concurrent.futures
import subprocess
import time

import httpx
import pytest

from tests.fixtures.runner_process import RunnerProcess
from tests.runner.conftest import StartRunner
from tests.runner.helpers import execute
from tests.runner.session.helpers import SessionClient, new_session_id, tree_digest

PYPROJECT = '[project]\nname = "mypkg"\nversion = "0.1"\n'


def test_multi_turn_state_survives(session_runner: RunnerProcess) -> None:
    """A file, a pip install --target and a sqlite database persist across executes."""
    with SessionClient(session_runner) as session:
        first = session.execute(
            "mkdir -p src/mypkg && echo 'VALUE = 42' > src/mypkg/__init__.py\n"
            f"printf '{PYPROJECT}' > src/pyproject.toml\n"
            "python3 -m pip install -q --no-index --no-build-isolation --target pkgs ./src\n"
            "python3 -c \"import sqlite3; c = sqlite3.connect('db.sqlite'); "
            "c.execute('create table t (v int)'); c.execute('insert into t values (7)'); "
            'c.commit()"\n'
            "echo note > notes.txt",
            language="bash",
        )
        assert first["status"] == "ok", first
        second = session.execute(
            "import sys, sqlite3\n"
            "sys.path.insert(0, 'pkgs')\n"
            "import mypkg\n"
            "rows = sqlite3.connect('db.sqlite').execute('select v from t').fetchall()\n"
            "print(mypkg.VALUE, rows, open('notes.txt').read().strip())"
        )
        assert second["stdout"] == "42 [(7,)] note\n", second
        assert second["session_id"] == session.session_id


def test_pinned_uid_is_stable_and_not_shared(session_runner: RunnerProcess) -> None:
    code = "import os, time\ntime.sleep(0.3)\nprint(os.getuid())"
    with SessionClient(session_runner) as session:
        uids = {int(session.execute(code)["stdout"]) for _ in range(3)}
        assert len(uids) == 1
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            fresh = list(
                pool.map(lambda _: execute(session_runner, language="python", code=code), range(4))
            )
        fresh_uids = {int(r["stdout"]) for r in fresh}
        assert uids.isdisjoint(fresh_uids)


def test_headerless_request_gets_fresh_workspace(session_runner: RunnerProcess) -> None:
    with SessionClient(session_runner) as session:
        session.execute("open('secret.txt', 'w').write('session data')")
        stateless = execute(
            session_runner, language="python", code="import os; print(os.listdir())"
        )
        assert stateless["stdout"] == "[]\n"
        assert stateless["session_id"] is None


def test_rebind_is_409_and_workspace_untouched(session_runner: RunnerProcess) -> None:
    with SessionClient(session_runner) as session:
        session.execute("open('a.txt', 'w').write('keep me')")
        before = tree_digest(session.workspace())
        with SessionClient(session_runner, new_session_id("other")) as intruder:
            for method, path, body in (
                ("POST", "/v1/execute", {"language": "bash", "code": "rm -rf ./*; touch pwned"}),
                ("GET", "/v1/session/checkpoint", None),
                ("GET", "/v1/session/files/a.txt", None),
                ("DELETE", "/v1/session", None),
            ):
                response = intruder.http.request(method, path, json=body)
                assert response.status_code == 409, (path, response.text)
                assert response.json()["error"]["code"] == "session_conflict"
        assert tree_digest(session.workspace()) == before


def test_concurrent_execute_in_one_session_is_busy(runner_factory: StartRunner) -> None:
    runner = runner_factory(SANDCELL_RUNNER_SESSIONS="1", SANDCELL_RUNNER_SESSION_WAIT_MS="200")
    with SessionClient(runner) as session, concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(session.execute, "sleep 2; echo done", "bash")
        time.sleep(0.5)
        response = session.http.post("/v1/execute", json={"language": "bash", "code": "true"})
        assert slow.result()["stdout"] == "done\n"
    assert response.status_code == 409
    assert response.json()["error"] == {
        "code": "session_busy",
        "message": response.json()["error"]["message"],
        "retryable": True,
    }


def test_release_wipes_and_allows_rebind(session_runner: RunnerProcess) -> None:
    with SessionClient(session_runner) as session:
        session.execute("open('a.txt', 'w').write('x')")
        workspace = session.workspace()
        assert session.http.delete("/v1/session").status_code == 204
        assert not workspace.exists()
        health_url = session_runner.url + "/health"
        assert httpx.get(health_url, headers=session_runner.headers()).json()["session_id"] is None
    with SessionClient(session_runner, new_session_id("next")) as other:
        assert other.execute("import os; print(os.listdir())")["stdout"] == "[]\n"


def test_release_right_after_a_restore_leaves_no_workspace(session_runner: RunnerProcess) -> None:
    """The workspace a restore replaced is removed after the answer; a release that follows
    at once still waits for that removal, so no file of the session's UID is left behind."""
    with SessionClient(session_runner) as session:
        session.execute("open('before.txt', 'w').write('x' * 100_000)")
        archive = session.checkpoint()
        replaced = session.workspace()
        assert session.restore(archive).status_code == 200
        restored = session.workspace()
        assert restored != replaced
        assert session.http.delete("/v1/session").status_code == 204
        assert not replaced.exists()
        assert not restored.exists()
        assert list((session_runner.workspace_root / "session").glob("ws-*")) == []


def test_failed_wipe_quarantines(session_runner: RunnerProcess) -> None:
    """If the wipe fails the runner keeps the UID, reports quarantined and refuses work."""
    with SessionClient(session_runner) as session:
        session.execute("open('a.txt', 'w').write('x')")
        session_dir = session_runner.workspace_root / "session"
        # An immutable parent makes removing the workspace directory fail (EPERM).
        subprocess.run(["chattr", "+i", str(session_dir)], check=True)
        try:
            response = session.http.delete("/v1/session")
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "quarantined"
            health = httpx.get(
                session_runner.url + "/health", headers=session_runner.headers()
            ).json()
            assert health["status"] == "quarantined"
            for headers in ({}, {"X-Runtime-Session-Id": session.session_id}):
                refused = httpx.post(
                    session_runner.url + "/v1/execute",
                    json={"language": "bash", "code": "true"},
                    headers={**session_runner.headers(), **headers},
                )
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "quarantined"
        finally:
            subprocess.run(["chattr", "-i", str(session_dir)], check=True)


def test_sessions_disabled_exposes_nothing(runner: RunnerProcess) -> None:
    sid = new_session_id()
    for method, path in (
        ("GET", "/v1/session/checkpoint"),
        ("POST", "/v1/session/restore"),
        ("DELETE", "/v1/session"),
        ("GET", "/v1/session/files/a.txt"),
        ("PUT", "/v1/session/files/a.txt"),
    ):
        response = httpx.request(
            method,
            runner.url + path,
            headers={**runner.headers(), "X-Runtime-Session-Id": sid},
        )
        assert response.status_code == 404, path
    refused = httpx.post(
        runner.url + "/v1/execute",
        json={"language": "bash", "code": "true"},
        headers={**runner.headers(), "X-Runtime-Session-Id": sid},
    )
    assert refused.status_code == 400


@pytest.mark.parametrize("value", ["rt_short", "chat-7", "rt_" + "G" * 64])
def test_invalid_session_header_rejected(session_runner: RunnerProcess, value: str) -> None:
    response = httpx.post(
        session_runner.url + "/v1/execute",
        json={"language": "bash", "code": "true"},
        headers={**session_runner.headers(), "X-Runtime-Session-Id": value},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_request"


def test_output_diffing_across_turns(session_runner: RunnerProcess) -> None:
    with SessionClient(session_runner) as session:
        first = session.execute("open('a.txt','w').write('1'); open('b.txt','w').write('2')")
        assert sorted(f["name"] for f in first["files"]) == ["a.txt", "b.txt"]
        second = session.execute("open('c.txt','w').write('3')")
        assert [f["name"] for f in second["files"]] == ["c.txt"]
        third = session.execute("open('a.txt','w').write('changed')")
        assert [f["name"] for f in third["files"]] == ["a.txt"]
        fourth = session.execute("pass")
        assert fourth["files"] == []
