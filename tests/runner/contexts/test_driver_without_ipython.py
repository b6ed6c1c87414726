"""The Python driver on an interpreter without IPython: cells are plain Python, as before.

The driver runs unjailed here on the test's own interpreter (the venv's, which has
no IPython), over the same pipes the runner gives it.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandcell_runner.contexts.drivers import DRIVERS


class Driver:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        assert self.receive()["t"] == "ready"

    def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        (size,) = struct.unpack(">I", self.process.stdout.read(4))
        message: dict[str, Any] = json.loads(self.process.stdout.read(size))
        return message

    def run(self, code: str) -> list[dict[str, Any]]:
        assert self.process.stdin is not None
        body = json.dumps({"op": "run", "code": code, "env": {}}).encode()
        self.process.stdin.write(struct.pack(">I", len(body)) + body)
        self.process.stdin.flush()
        events = [self.receive()]
        while events[-1]["t"] != "end":
            events.append(self.receive())
        return events


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[Driver]:
    job, workspace = tmp_path / "job", tmp_path / "ws"
    workspace.mkdir()
    for name, data in DRIVERS["python"].files().items():
        (job / name).parent.mkdir(parents=True, exist_ok=True)
        (job / name).write_bytes(data)
    probe = subprocess.run([sys.executable, "-I", "-c", "import IPython"], check=False)
    assert probe.returncode != 0, "this test needs an interpreter without IPython"
    process = subprocess.Popen(
        [sys.executable, "-I", str(job / "driver.py"), str(workspace)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "HOME": str(workspace), "LANG": "C.UTF-8"},
    )
    with process:  # closes both pipes after the wait
        try:
            yield Driver(process)
        finally:
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=30)


def test_ipython_syntax_is_a_syntax_error_and_plain_cells_run(driver: Driver) -> None:
    (error, end) = driver.run("!echo hi")
    assert error["t"] == "error"
    assert error["name"] == "SyntaxError"
    assert error["traceback"].startswith('  File "<cell-1>", line 1\n    !echo hi\n')
    assert "ast.py" not in error["traceback"]
    assert end["status"] == "error"
    (result, end) = driver.run("x = 41\nx + 1")
    assert result == {"t": "result", "data": {"text/plain": "42"}, "main": True}
    assert end["status"] == "ok"
