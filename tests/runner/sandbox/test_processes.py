"""Sandbox processes over the runner's HTTP routes: real runner, real nsjail.

What the envd adapter relies on: separate stdout/stderr, runner-assigned pids,
stdin, signals through the sandbox init, a terminal made inside the jail (its own
devpts), reattaching, a lifetime bound, an environment built from nothing.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sandcell_protocol import sandbox_messages as sm
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner

SESSION = "rt_" + "e" * 64


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with (
        traversable_dir() as root,
        running_runner(root, env={"SANDCELL_RUNNER_SESSIONS": "1"}) as process,
    ):
        runner: RunnerProcess = process
        with runner.client() as http:
            http.headers["X-Runtime-Session-Id"] = SESSION
            yield http


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        event: dict[str, Any] = json.loads(line)
        if event["type"] == "data":
            event["data"] = base64.b64decode(event["data"])
        yield event


def run(client: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    with client.stream("POST", sm.SANDBOX_PROCESSES, json=body) as response:
        assert response.status_code == 200, response.read()
        return [e for e in _events(response) if e["type"] != "keepalive"]


def output(events: list[dict[str, Any]], stream: str) -> bytes:
    return b"".join(e["data"] for e in events if e["type"] == "data" and e["stream"] == stream)


def test_stdout_and_stderr_apart_with_the_exit_code(client: httpx.Client) -> None:
    events = run(client, cmd="/bin/bash", args=["-c", "echo out; echo err >&2; exit 3"])
    assert events[0]["type"] == "start"
    assert events[0]["pid"] >= 1000
    assert output(events, "stdout") == b"out\n"
    assert output(events, "stderr") == b"err\n"
    assert events[-1] == {
        "type": "end",
        "exit_code": 3,
        "signal": None,
        "status": "exit status 3",
        "error": None,
    }


def test_the_environment_is_built_from_nothing(client: httpx.Client) -> None:
    events = run(client, cmd="/usr/bin/env", envs={"MINE": "1"})
    env = dict(line.split("=", 1) for line in output(events, "stdout").decode().splitlines())
    assert env["MINE"] == "1"
    assert env["HOME"] == "/home/user"
    assert not [k for k in env if k.startswith("SANDCELL")]


def test_a_pty_is_made_inside_the_jail(client: httpx.Client) -> None:
    """The terminal's devpts is the job's own: it sees its terminal and no other."""
    events = run(
        client,
        cmd="/bin/bash",
        args=["-c", "tty; stty size; ls /dev/pts"],
        pty={"cols": 90, "rows": 20},
    )
    seen = output(events, "pty").decode().split()
    assert seen == ["/dev/pts/0", "20", "90", "0", "ptmx"]
    assert output(events, "stdout") == b""


def test_signals_reattach_and_stdin(client: httpx.Client) -> None:
    """A background process is listed, fed, followed from a second stream and ended by
    SIGTERM (the init forwards it to the process group)."""
    first: list[dict[str, Any]] = []
    started = threading.Event()

    def follow() -> None:
        with client.stream(
            "POST",
            sm.SANDBOX_PROCESSES,
            json={
                "cmd": "/bin/bash",
                "args": ["-c", "read x; echo got:$x; sleep 300"],
                "stdin": True,
                "tag": "bg",
            },
        ) as response:
            for event in _events(response):
                first.append(event)
                started.set()

    thread = threading.Thread(target=follow)
    thread.start()
    assert started.wait(30)
    pid = first[0]["pid"]
    listed = client.get(sm.SANDBOX_PROCESSES).json()["processes"]
    assert [(p["pid"], p["tag"]) for p in listed] == [(pid, "bg")]

    with client.stream("GET", f"{sm.SANDBOX_PROCESSES}/{pid}/events") as attached:
        events = _events(attached)
        assert next(events) == {"type": "start", "pid": pid}
        assert (
            client.post(f"{sm.SANDBOX_PROCESSES}/{pid}/input", content=b"hi\n").status_code == 204
        )
        for event in events:
            if event["type"] == "data":
                assert event["data"] == b"got:hi\n"
                break
        signal = client.post(f"{sm.SANDBOX_PROCESSES}/{pid}/signal", json={"signal": "SIGTERM"})
        assert signal.status_code == 204
        ends = [e for e in events if e["type"] == "end"]
    thread.join(30)
    assert ends == [
        {
            "type": "end",
            "exit_code": None,
            "signal": "SIGTERM",
            "status": "signal: terminated",
            "error": None,
        }
    ]
    assert first[-1] == ends[0]
    assert client.get(sm.SANDBOX_PROCESSES).json()["processes"] == []
    assert client.get(f"{sm.SANDBOX_PROCESSES}/{pid}/events").status_code == 404


def test_timeout_ms_bounds_the_life_of_a_process(client: httpx.Client) -> None:
    events = run(client, cmd="/bin/sleep", args=["60"], timeout_ms=300)
    assert events[-1]["signal"] in ("SIGTERM", "SIGKILL")


def test_bad_requests_are_4xx(client: httpx.Client) -> None:
    bad_cwd = client.post(sm.SANDBOX_PROCESSES, json={"cmd": "/bin/true", "cwd": "/etc"})
    assert bad_cwd.status_code == 400
    missing = client.post(f"{sm.SANDBOX_PROCESSES}/4242/signal", json={"signal": "SIGKILL"})
    assert missing.status_code == 404
    unknown = client.post(sm.SANDBOX_FS, json={"type": "chmod", "path": "a"})
    assert unknown.status_code == 400
