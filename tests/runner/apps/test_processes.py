"""Background processes: start, list, logs (lines, filter, follow), stdin, stop, exit status."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil
import pytest

from tests.fixtures.runner_process import RunnerProcess
from tests.runner.apps.helpers import AppClient


def test_start_list_and_exit_code(app: AppClient) -> None:
    """A process that ends by itself is reported with its exit code, never restarted."""
    info = app.start("quick", "echo starting; echo oops >&2; exit 3")
    assert info["pid"] > 0
    assert info["exit_code"] is None
    done = app.wait_exited("quick")
    assert done["exit_code"] == 3
    assert done["signal"] is None
    assert done["pid"] is None
    assert done["ended_at_s"] >= done["started_at_s"]
    lines = app.logs("quick")["lines"]
    # stdout and stderr are merged in one log, in order.
    assert lines[:2] == ["starting", "oops"]
    assert lines[-1] == "[sandcell] process exited (exit code 3)"
    time.sleep(0.5)
    assert app.process("quick")["state"] == "exited"


def test_running_tag_conflicts_and_unknown_tag_is_404(app: AppClient) -> None:
    app.start("sleeper", "sleep 60")
    again = app.http.post("/v1/session/processes", json={"tag": "sleeper", "command": "true"})
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "session_conflict"
    assert app.http.get("/v1/session/processes/nope/logs").status_code == 404
    assert app.http.delete("/v1/session/processes/nope").status_code == 404
    bad = app.http.post("/v1/session/processes", json={"tag": "no spaces", "command": "true"})
    assert bad.status_code == 400
    stopped = app.http.delete("/v1/session/processes/sleeper").json()
    assert stopped["state"] == "exited"
    assert stopped["signal"] == "SIGTERM"
    # An exited tag may be started again (a new process, not a restart).
    app.start("sleeper", "exit 0")
    assert app.wait_exited("sleeper")["exit_code"] == 0


def test_stop_sends_term_to_a_server_that_has_no_handler(app: AppClient) -> None:
    """The jail's init forwards SIGTERM, so PID 1's signal protection does not swallow it."""
    app.start("srv", "exec python3 -m http.server 8101 --bind 127.0.0.1")
    app.wait_log("srv", "Serving HTTP")
    started = time.monotonic()
    info = app.http.delete("/v1/session/processes/srv").json()
    assert info == {**info, "state": "exited", "signal": "SIGTERM", "exit_code": None}
    assert time.monotonic() - started < 2.5  # ended by TERM, not by the KILL after the grace


def test_stop_kills_after_the_grace(app: AppClient) -> None:
    app.start("stubborn", "trap '' TERM; echo ready; sleep 300 & wait")
    app.wait_log("stubborn", "ready")
    info = app.http.delete("/v1/session/processes/stubborn").json()
    assert info["state"] == "exited"
    assert info["signal"] == "SIGKILL"


def test_timeout_stops_the_process(app: AppClient) -> None:
    app.start("limited", "sleep 100", timeout_ms=700)
    info = app.wait_exited("limited", timeout_s=15)
    assert info["signal"] == "SIGTERM"
    assert "[sandcell] timeout reached; stopping" in app.logs("limited")["lines"]


def test_logs_lines_and_filter(app: AppClient) -> None:
    app.start("counter", 'for i in $(seq 1 30); do echo "alpha $i"; echo "beta $i"; done')
    app.wait_exited("counter")
    last = app.logs("counter", lines=3)
    assert last["lines"] == ["alpha 30", "beta 30", "[sandcell] process exited (exit code 0)"]
    assert last["truncated"] is False
    alphas = app.logs("counter", lines=2, filter=r"^alpha \d+$")
    assert alphas["lines"] == ["alpha 29", "alpha 30"]
    assert len(app.logs("counter", lines=1000, filter="^alpha")["lines"]) == 30
    assert app.logs("counter", lines=0)["lines"] == []


def test_bad_log_queries_are_400(app: AppClient) -> None:
    app.start("target", "echo some output")
    app.wait_exited("target")
    for params in ({"filter": "("}, {"filter": "a" * 201}, {"lines": "-1"}, {"lines": "many"}):
        response = app.http.get("/v1/session/processes/target/logs", params=params)
        assert response.status_code == 400, (params, response.text)
        assert response.json()["error"]["code"] == "bad_request"
    assert app.logs("target", filter="a" * 200)["lines"] == []


def test_catastrophic_regex_is_cut_off(app: AppClient) -> None:
    """A backtracking pattern runs in a child under a time budget, not in the runner."""
    app.start("evil", "python3 -c \"print('a' * 40 + '!')\"")
    app.wait_exited("evil")
    started = time.monotonic()
    response = app.http.get("/v1/session/processes/evil/logs", params={"filter": "^(a+)+$"})
    assert response.status_code == 400
    assert "did not finish" in response.json()["error"]["message"]
    assert time.monotonic() - started < 10
    # The runner is still responsive.
    assert app.http.get("/v1/session/processes").status_code == 200


def test_long_lines_are_cut_and_the_ring_is_bounded(app: AppClient) -> None:
    app.start("flood", "python3 -c \"print('x' * 10000); [print(i) for i in range(2500)]\"")
    app.wait_exited("flood")
    everything = app.logs("flood", lines=10000)
    assert len(everything["lines"]) == 2000
    assert everything["truncated"] is True
    assert everything["lines"][-1].startswith("[sandcell] process exited")
    app.start("wide", "python3 -c \"print('y' * 10000)\"")
    app.wait_exited("wide")
    wide = app.logs("wide", lines=5)
    assert wide["truncated"] is True
    assert wide["lines"][0].startswith("y" * 4096)
    assert len(wide["lines"][0]) < 4200


def test_follow_streams_new_lines_and_stdin_reaches_the_process(app: AppClient) -> None:
    command = "python3 -c \"import sys\nfor line in sys.stdin: print('got', line.strip())\""
    app.start("echoer", command)
    received: list[str] = []
    with app.http.stream(
        "GET", "/v1/session/processes/echoer/logs", params={"follow": "1", "lines": "0"}
    ) as stream:
        assert stream.headers["content-type"].startswith("application/x-ndjson")
        lines = stream.iter_lines()
        response = app.http.post("/v1/session/processes/echoer/stdin", content=b"hello\n")
        assert response.status_code == 204
        received.append(json.loads(next(lines))["line"])
        app.http.post("/v1/session/processes/echoer/stdin", content=b"again\n", params={"eof": 1})
        received += [json.loads(line)["line"] for line in lines]
    # The stream ends by itself when the process exits.
    assert received[:2] == ["got hello", "got again"]
    assert received[-1] == "[sandcell] process exited (exit code 0)"
    late = app.http.post("/v1/session/processes/echoer/stdin", content=b"late\n")
    assert late.status_code == 400


def test_follow_with_filter(app: AppClient) -> None:
    app.start("ticker", 'read go; for i in 1 2 3 4 5 6; do echo "tick $i"; echo noise; done')
    with app.http.stream(
        "GET",
        "/v1/session/processes/ticker/logs",
        params={"follow": "1", "lines": "0", "filter": "^tick [246]$"},
    ) as stream:
        app.http.post("/v1/session/processes/ticker/stdin", content=b"go\n")
        lines = [json.loads(line)["line"] for line in stream.iter_lines()]
    assert lines == ["tick 2", "tick 4", "tick 6"]


def test_process_env_cwd_and_limits(app: AppClient) -> None:
    app.put("sub/dir/marker.txt", "here")
    app.start(
        "env",
        'echo "$GREETING $(pwd) $(cat marker.txt)"',
        env={"GREETING": "hi"},
        cwd="sub/dir",
        limits={"memory_mib": 64, "pids": 16},
    )
    app.wait_exited("env")
    assert app.logs("env")["lines"][0] == "hi /mnt/data/sub/dir here"
    bad = app.http.post(
        "/v1/session/processes", json={"tag": "badcwd", "command": "true", "cwd": "../etc"}
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_path"
    missing = app.http.post(
        "/v1/session/processes", json={"tag": "nocwd", "command": "true", "cwd": "nowhere"}
    )
    assert missing.json()["error"]["code"] == "invalid_path"
    unknown = app.http.post("/v1/session/processes", json={"tag": "x", "command": "true", "y": 1})
    assert unknown.status_code == 400


def test_memory_limit_applies(app: AppClient) -> None:
    app.start(
        "hog",
        "python3 -c \"x = bytearray(200 * 1024 * 1024); print('allocated')\"",
        limits={"memory_mib": 64},
    )
    info = app.wait_exited("hog")
    assert "allocated" not in app.logs("hog")["lines"]
    assert info["exit_code"] != 0 or info["signal"] is not None


def test_processes_need_a_session_header(app_runner: RunnerProcess) -> None:
    response = httpx.get(app_runner.url + "/v1/session/processes", headers=app_runner.headers())
    assert response.status_code == 400
    unauthorized = httpx.get(app_runner.url + "/v1/session/processes")
    assert unauthorized.status_code == 401


def test_processes_survive_a_checkpoint(app: AppClient) -> None:
    """Checkpoints take the session lock but leave processes running."""
    app.put("index.html", "<html><head></head><body>still here</body></html>")
    app.start("durable", "exec python3 -m http.server 8102 --bind 127.0.0.1")
    app.wait_log("durable", "Serving HTTP")
    archive = app.checkpoint()
    assert archive
    assert app.process("durable")["state"] == "running"
    assert "still here" in app.preview(8102, "index.html").text


def test_release_kills_the_session_processes(fresh_runner: RunnerProcess) -> None:
    with AppClient(fresh_runner) as client:
        info = client.start("forever", "sleep 1000")
        pid = info["pid"]
        os.kill(pid, 0)
        assert client.http.delete("/v1/session").status_code == 204
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        # A new session on this runner starts with no processes.
        assert client.http.get("/v1/session/processes").json() == {"processes": []}


def test_processes_do_not_outlive_a_killed_runner(fresh_runner: RunnerProcess) -> None:
    """SIGKILL of the runner takes its background processes with it (no orphans)."""
    with AppClient(fresh_runner) as client:
        info = client.start("orphan", "sleep 1000 & sleep 1000; wait")
        jail = psutil.Process(info["pid"])
        deadline = time.monotonic() + 10
        tree = [jail]
        while len(tree) < 5 and time.monotonic() < deadline:  # nsjail, init, bash, 2 sleeps
            tree = [jail, *jail.children(recursive=True)]
            time.sleep(0.05)
        assert len(tree) >= 5, tree
        os.kill(fresh_runner.process.pid, signal.SIGKILL)
        fresh_runner.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    alive = tree
    while alive and time.monotonic() < deadline:
        alive = [p for p in tree if _alive(p)]
        time.sleep(0.05)
    assert not alive


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_in_place_restore_leaves_processes_running(fresh_runner: RunnerProcess) -> None:
    """A restore swaps the workspace under the lock but stops nothing: a running process
    keeps the tree it started with, new commands see the restored one (and still reach
    the process on localhost)."""
    with AppClient(fresh_runner) as client:
        client.put("page.txt", "before")
        archive = client.checkpoint()
        client.put("page.txt", "after")
        client.start("files", "exec python3 -m http.server 8111 --bind 127.0.0.1")
        client.wait_log("files", "Serving HTTP")
        assert client.restore(archive).status_code == 200
        assert client.process("files")["state"] == "running"
        assert client.preview(8111, "page.txt").text == "after"
        result = client.execute(
            "import urllib.request\n"
            "print(open('page.txt').read())\n"
            "print(urllib.request.urlopen('http://127.0.0.1:8111/page.txt').read().decode())\n"
        )
        assert result["stdout"] == "before\nafter\n", result
