"""Contexts and the session's lifecycle: release, restore, a killed runner."""

from __future__ import annotations

import os
import signal
import time

import psutil

from tests.fixtures.runner_process import RunnerProcess
from tests.runner.contexts.helpers import ContextClient


def _drivers(runner: RunnerProcess) -> list[psutil.Process]:
    tree = psutil.Process(runner.process.pid).children(recursive=True)
    return [
        p
        for p in tree
        if p.name() != "nsjail" and any(part.endswith("driver.py") for part in p.cmdline())
    ]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_new_session_sees_neither_the_old_contexts_nor_their_files(
    fresh_runner: RunnerProcess,
) -> None:
    """Release ends the session's interpreters; the next session starts from nothing."""
    first = ContextClient(fresh_runner)
    context_id = first.create(context_id="notebook")
    first.run(context_id, "secret = 'first'\nopen('mine.txt', 'w').write(secret)")
    (driver,) = _drivers(fresh_runner)
    assert first.http.delete("/v1/session").status_code == 204
    assert not _alive(driver)
    with first, ContextClient(fresh_runner) as second:
        assert second.http.get("/v1/session/contexts").json() == {"contexts": []}
        missing = second.run_raw("notebook", "secret")
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
        other = second.create(context_id="notebook")
        text = second.main_text(other, "import os\n(sorted(os.listdir('.')), 'secret' in dir())")
        assert text == "([], False)"
        # The first session, while the runner is bound to the second, is refused.
        refused = first.http.get("/v1/session/contexts")
        assert refused.status_code == 409


def test_a_restore_loses_the_contexts(fresh_runner: RunnerProcess) -> None:
    """The interpreters ran in the workspace a restore replaces: they are gone, and say so."""
    with ContextClient(fresh_runner) as client:
        context_id = client.create()
        client.run(context_id, "x = 1\nopen('kept.txt', 'w').write('file')")
        archive = client.checkpoint()
        assert client.restore(archive).status_code == 200
        lost = client.run_raw(context_id, "x")
        assert (lost.status_code, lost.json()["error"]["code"]) == (409, "context_lost")
        assert "restored" in lost.json()["error"]["message"]
        assert client.http.post(f"/v1/session/contexts/{context_id}/restart").status_code == 200
        # Files persist through the checkpoint; variables do not.
        assert client.main_text(context_id, "open('kept.txt').read()") == "'file'"
        assert client.run(context_id, "x")["error"]["name"] == "NameError"


def test_a_restore_into_a_new_runner_knows_the_contexts_it_lost(
    fresh_runner: RunnerProcess, other_runner: RunnerProcess
) -> None:
    """The checkpoint names the session's contexts: a new sandbox answers context_lost
    for them, never a run in a silently empty namespace."""
    with ContextClient(fresh_runner) as first:
        first.create(context_id="nb")
        first.run("nb", "x = 1\nopen('kept.txt', 'w').write('file')")
        archive = first.checkpoint()
    with ContextClient(other_runner, first.session_id) as second:
        assert second.restore(archive).status_code == 200
        listed = second.http.get("/v1/session/contexts").json()["contexts"]
        assert [(c["context_id"], c["state"]) for c in listed] == [("nb", "lost")]
        lost = second.run_raw("nb", "x")
        assert (lost.status_code, lost.json()["error"]["code"]) == (409, "context_lost")
        assert second.http.post("/v1/session/contexts/nb/restart").status_code == 200
        assert second.main_text("nb", "open('kept.txt').read()") == "'file'"


def test_killing_the_runner_leaves_no_interpreter(fresh_runner: RunnerProcess) -> None:
    with ContextClient(fresh_runner) as client:
        context_id = client.create()
        client.run(context_id, "import subprocess\nchild = subprocess.Popen(['sleep', '1000'])")
        tree = psutil.Process(fresh_runner.process.pid).children(recursive=True)
        assert _drivers(fresh_runner)
        assert any("sleep" in p.name() for p in tree)
        os.kill(fresh_runner.process.pid, signal.SIGKILL)
        fresh_runner.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    alive = tree
    while alive and time.monotonic() < deadline:
        alive = [p for p in tree if _alive(p)]
        time.sleep(0.05)
    assert not alive
