"""POST /v1/execute against a real runner process running jobs under real nsjail."""

from __future__ import annotations

import json
import subprocess

import httpx
import psutil
import pytest

from sandcell_protocol import ExecuteResult, decode
from tests.fixtures.runner_process import RunnerProcess
from tests.runner.helpers import b64, execute, unb64

HELLO = {
    "python": 'print("hello from python")',
    "bash": 'echo "hello from bash"',
    "sh": 'echo "hello from sh"',
    "node": 'console.log("hello from node")',
    "typescript": 'const who: string = "typescript"; console.log(`hello from ${who}`)',
    "c": '#include <stdio.h>\nint main(void) { puts("hello from c"); return 0; }\n',
    "cpp": '#include <iostream>\nint main() { std::cout << "hello from cpp" << std::endl; }\n',
}


def test_languages_route_lists_discovered(runner: RunnerProcess) -> None:
    with runner.client() as client:
        body = client.get("/v1/languages").json()
        again = client.get("/v1/languages").json()
    names = {item["name"] for item in body["languages"]}
    assert {"python", "bash", "sh"} <= names
    assert all(item["version"] for item in body["languages"])
    # Probed when first asked (not at start-up): the interpreter's own answer.
    python = next(item for item in body["languages"] if item["name"] == "python")
    probed = subprocess.run(["/usr/bin/python3", "--version"], capture_output=True, text=True)
    assert probed.stdout.split()[1] == python["version"]
    assert again == body


def test_hello_world_in_every_discovered_language(runner: RunnerProcess) -> None:
    """Every language /v1/languages offers runs its hello world."""
    with runner.client() as client:
        names = [item["name"] for item in client.get("/v1/languages").json()["languages"]]
    assert names
    for name in names:
        result = execute(runner, language=name, code=HELLO[name])
        assert result["status"] == "ok", (name, result["stderr"][:1500])
        assert result["stdout"] == f"hello from {name}\n"
        assert result["exit_code"] == 0
        decode(json.dumps(result).encode(), ExecuteResult)


@pytest.mark.parametrize("code", [0, 1, 3, 42, 200])
def test_exit_codes(runner: RunnerProcess, code: int) -> None:
    result = execute(runner, language="bash", code=f"exit {code}")
    assert result["exit_code"] == code
    assert result["status"] == ("ok" if code == 0 else "error")
    assert result["signal"] is None


def test_stdin_is_delivered(runner: RunnerProcess) -> None:
    result = execute(
        runner, language="python", code="import sys; print(sys.stdin.read().upper())", stdin="abc"
    )
    assert result["stdout"] == "ABC\n"


def test_bare_cat_does_not_hang_without_stdin(runner: RunnerProcess) -> None:
    result = execute(runner, language="bash", code="cat; echo done", timeout_ms=5000)
    assert result["status"] == "ok"
    assert result["stdout"] == "done\n"


def test_env_and_args(runner: RunnerProcess) -> None:
    result = execute(
        runner,
        language="python",
        code="import os, sys; print(os.environ['GREETING'], sys.argv[1:])",
        env={"GREETING": "hi"},
        args=["a b", "c"],
    )
    assert result["stdout"] == "hi ['a b', 'c']\n"


def test_job_environment_is_minimal(runner: RunnerProcess) -> None:
    result = execute(runner, language="python", code="import os; print(sorted(os.environ))")
    names = set(eval(result["stdout"]))
    assert names <= {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONPATH", "LC_CTYPE"}
    assert "SANDCELL_RUNNER_TOKEN" not in names


def test_inline_files_in_and_outputs_out(runner: RunnerProcess) -> None:
    code = (
        "import os\n"
        "data = open('data/in.txt').read()\n"
        "os.makedirs('out', exist_ok=True)\n"
        "open('out/result.txt', 'w').write(data[::-1])\n"
        "print(os.access('tool.sh', os.X_OK))\n"
    )
    result = execute(
        runner,
        language="python",
        code=code,
        inline_files=[
            {"name": "data/in.txt", "content_b64": b64("abcdef")},
            {"name": "tool.sh", "content_b64": b64("#!/bin/sh\n"), "executable": True},
        ],
    )
    assert result["status"] == "ok", result
    assert result["stdout"] == "True\n"
    files = {f["name"]: f for f in result["files"]}
    # Inputs the job did not change are not returned as outputs.
    assert set(files) == {"out/result.txt"}
    assert unb64(files["out/result.txt"]["content_b64"]) == b"fedcba"
    assert files["out/result.txt"]["size"] == 6


def test_streaming_order_and_final_event(runner: RunnerProcess) -> None:
    code = "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.05; done"
    lines = []
    with httpx.stream(
        "POST",
        runner.url + "/v1/execute",
        json={"language": "bash", "code": code},
        headers=runner.headers(Accept="application/x-ndjson"),
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    types = [line["type"] for line in lines]
    assert types[-1] == "result"
    assert types.count("result") == 1
    stdout = "".join(line["data"] for line in lines if line["type"] == "stdout")
    stderr = "".join(line["data"] for line in lines if line["type"] == "stderr")
    assert stdout == "out1\nout2\nout3\n"
    assert stderr == "err1\nerr2\nerr3\n"
    assert lines[-1]["result"]["stdout"] == stdout
    assert lines[-1]["result"]["status"] == "ok"


def test_streamed_and_json_answers_render_the_same_run(runner: RunnerProcess) -> None:
    """The NDJSON stream and the JSON answer are two renderings of one execute: a refusal
    before the jail runs is the same HTTP error in both, and a run ends the same way."""
    missing = {"storage_session": "nope", "object_id": "nothing", "name": "x.txt"}
    refused = {"language": "bash", "code": "true", "files": [missing]}
    plain = httpx.post(runner.url + "/v1/execute", json=refused, headers=runner.headers())
    streamed = httpx.post(
        runner.url + "/v1/execute",
        json=refused,
        headers=runner.headers(Accept="application/x-ndjson"),
    )
    assert plain.status_code == streamed.status_code == 400
    assert streamed.headers["content-type"].startswith("application/json")
    assert plain.json() == streamed.json()
    assert streamed.json()["error"]["code"] == "input_missing"

    ran = {"language": "bash", "code": "echo out; echo err >&2; exit 3"}
    plain = httpx.post(runner.url + "/v1/execute", json=ran, headers=runner.headers())
    streamed = httpx.post(
        runner.url + "/v1/execute", json=ran, headers=runner.headers(Accept="application/x-ndjson")
    )
    last = json.loads(streamed.text.splitlines()[-1])
    assert last["type"] == "result"
    measured = ("wall_ms", "cpu_ms", "max_rss_kib")
    same = {k: v for k, v in plain.json().items() if k not in measured}
    assert {k: v for k, v in last["result"].items() if k not in measured} == same
    assert same["status"] == "error"
    assert (same["exit_code"], same["stdout"], same["stderr"]) == (3, "out\n", "err\n")


def test_timeout_kills_tree_keeps_partial_output(runner: RunnerProcess) -> None:
    result = execute(
        runner,
        language="bash",
        code="echo started; (sleep 100 &); sleep 100",
        timeout_ms=1000,
    )
    assert result["status"] == "timeout"
    assert result["stdout"] == "started\n"
    # Prompt: the wall clock is the limit plus teardown, not the sleep.
    assert result["wall_ms"] < 10_000


def test_output_flood_hits_output_limit(runner: RunnerProcess) -> None:
    result = execute(
        runner,
        language="python",
        code="import sys\nwhile True: sys.stdout.write('x' * 65536)",
        limits={"stdout_bytes": 100_000},
        timeout_ms=20_000,
    )
    assert result["status"] == "output_limit"
    assert result["stdout_truncated"] is True
    assert len(result["stdout"]) == 100_000


def test_stderr_flood_truncates_and_job_continues(runner: RunnerProcess) -> None:
    code = "import sys\nsys.stderr.write('e' * 200000)\nsys.stderr.flush()\nprint('finished')"
    result = execute(runner, language="python", code=code, limits={"stderr_bytes": 1000})
    assert result["status"] == "ok"
    assert result["stderr_truncated"] is True
    assert len(result["stderr"]) == 1000
    assert result["stdout"] == "finished\n"


def test_memory_bomb_hits_memory_limit(runner: RunnerProcess) -> None:
    code = "chunks = []\nwhile True: chunks.append(bytearray(16 * 1024 * 1024))"
    result = execute(runner, language="python", code=code, limits={"memory_mib": 128})
    assert result["status"] == "memory_limit", result
    assert result["signal"] == "SIGKILL"


def test_killed_by_signal_is_signaled(runner: RunnerProcess) -> None:
    """A fault signal names itself (the job is PID 1 of its namespace, so a
    self-sent signal without a handler would be ignored; a fault is not)."""
    result = execute(runner, language="python", code="import ctypes\nctypes.string_at(0)")
    assert result["status"] == "signaled"
    assert result["signal"] == "SIGSEGV"
    assert result["exit_code"] is None


def test_peak_memory_is_the_jobs_not_the_runners(runner: RunnerProcess) -> None:
    """max_rss_kib follows the job: a tiny one stays tiny, a 96 MiB one reports it.

    nsjail is vforked from the runner, so its ru_maxrss starts at the runner's
    RSS; reporting that would make every small job look as big as the runner.
    """
    runner_rss_kib = psutil.Process(runner.process.pid).memory_info().rss // 1024
    small = execute(runner, language="bash", code="true")
    big = execute(runner, language="python", code="x = b'x' * (96 << 20)\nprint(len(x))")
    assert small["status"] == big["status"] == "ok"
    assert small["max_rss_kib"] < min(16 << 10, runner_rss_kib)
    assert big["max_rss_kib"] >= 96 << 10


def test_exit_137_is_an_error_not_a_kill(runner: RunnerProcess) -> None:
    result = execute(runner, language="bash", code="exit 137")
    assert result["status"] == "error"
    assert result["exit_code"] == 137


def test_resource_figures_are_measured(runner: RunnerProcess) -> None:
    result = execute(
        runner, language="python", code="x = sum(i * i for i in range(3_000_000))\nprint(x > 0)"
    )
    assert result["status"] == "ok"
    assert result["cpu_ms"] > 0
    assert result["wall_ms"] >= result["cpu_ms"] * 0.5
    assert result["max_rss_kib"] > 1000
