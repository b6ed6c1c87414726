"""Output caps as the contract says (issue 14, item 7), on a real runner under nsjail.

stdout past its cap kills the job: status ``output_limit``, output up to the cap
kept, ``stdout_truncated`` true, in the JSON answer and in the NDJSON stream
alike. Output that ends exactly at the cap is whole. stderr past its cap is cut,
the job goes on. (Session processes' logs are a ring, rotated, never a kill:
tests/runner/apps/test_processes.py.)
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.fixtures.runner_process import RunnerProcess
from tests.runner.helpers import execute

CAP = 65536
# A flood in chunks of exactly the cap: the read that fills the cap takes all of a
# chunk, so only the next read passes it (the case that used to answer "ok").
FLOOD = "import sys\nfor _ in range(1024): sys.stdout.write('x' * 65536)\nprint('survived')"


def _streamed(runner: RunnerProcess, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    stdout: list[str] = []
    result: dict[str, Any] = {}
    with httpx.stream(
        "POST",
        runner.url + "/v1/execute",
        json=body,
        headers=runner.headers(Accept="application/x-ndjson"),
        timeout=120,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            event = json.loads(line)
            if event["type"] == "stdout":
                stdout.append(event["data"])
            elif event["type"] == "result":
                result = event["result"]
    return "".join(stdout), result


def test_a_flood_past_the_cap_is_killed_as_output_limit(runner: RunnerProcess) -> None:
    """64 MiB written in cap-sized chunks with stdout_bytes = 64 KiB: killed, not ok."""
    result = execute(
        runner, language="python", code=FLOOD, limits={"stdout_bytes": CAP}, timeout_ms=30_000
    )
    assert result["status"] == "output_limit", {k: v for k, v in result.items() if k != "stdout"}
    assert result["signal"] == "SIGKILL"
    assert result["stdout_truncated"] is True
    assert result["stdout"] == "x" * CAP


def test_a_streamed_flood_is_killed_as_output_limit(runner: RunnerProcess) -> None:
    """The stream sends output up to the cap, then the result says output_limit."""
    body = {
        "language": "python",
        "code": FLOOD,
        "limits": {"stdout_bytes": CAP},
        "timeout_ms": 30_000,
    }
    streamed, result = _streamed(runner, body)
    assert result["status"] == "output_limit"
    assert result["stdout_truncated"] is True
    assert streamed == "x" * CAP
    assert result["stdout"] == streamed


@pytest.mark.parametrize("streamed", [False, True])
def test_output_exactly_at_the_cap_is_whole(runner: RunnerProcess, streamed: bool) -> None:
    """Exactly ``stdout_bytes`` bytes, then exit 0: ok, nothing truncated."""
    body = {
        "language": "python",
        "code": "import sys\nsys.stdout.write('y' * 65536)",
        "limits": {"stdout_bytes": CAP},
    }
    if streamed:
        text, result = _streamed(runner, body)
        assert text == "y" * CAP
    else:
        result = execute(runner, **body)
    assert result["status"] == "ok"
    assert result["stdout_truncated"] is False
    assert result["stdout"] == "y" * CAP


def test_stderr_past_its_cap_is_cut_and_the_job_goes_on(runner: RunnerProcess) -> None:
    code = (
        "import sys\nfor _ in range(64): sys.stderr.write('e' * 65536)\n"
        "sys.stderr.flush()\nprint('finished')"
    )
    result = execute(runner, language="python", code=code, limits={"stderr_bytes": CAP})
    assert result["status"] == "ok"
    assert result["stderr_truncated"] is True
    assert result["stderr"] == "e" * CAP
    assert result["stdout"] == "finished\n"
