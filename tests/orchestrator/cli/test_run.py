"""``sandcell run``: cells in a session's code context, from separate CLI processes."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from tests.orchestrator.cli.conftest import Cli, runner_processes


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_variables_persist_across_cli_calls_and_plots_become_files(cli: Cli) -> None:
    """Two processes, one interpreter: its runner outlives the first call."""
    first = cli.run("run", "--session", "nb", "x = 41")
    assert (first.returncode, first.stdout) == (0, ""), first.stderr
    second = cli.run("run", "--session", "nb", "print('sum:', x)\nx + 1")
    assert (second.returncode, second.stdout) == (0, "sum: 41\n42\n"), second.stderr
    plot = cli.run(
        "run",
        "--session",
        "nb",
        "--out",
        str(cli.home / "images"),
        "import matplotlib.pyplot as plt\nplt.figure(figsize=(3, 2), dpi=100)\nplt.plot([1, 2])",
    )
    assert plot.returncode == 0, plot.stderr
    text, image = plot.stdout.splitlines()
    assert text.startswith("[<matplotlib.lines.Line2D")
    assert _png_size(Path(image)) == (300, 200)
    assert Path(image).parent == cli.home / "images"
    # A named context is another namespace (an exception: exit 1 with its traceback);
    # --json gives the whole result; --restart empties a context.
    other = cli.run("run", "--session", "nb", "--context", "side", "--json", "x")
    assert other.returncode == 1
    assert json.loads(other.stdout)["error"]["name"] == "NameError"
    restarted = cli.run("run", "--session", "nb", "--restart", "'x' in dir()")
    assert restarted.stdout == "False\n"
    # The session's sandbox is still warm; destroying the session ends it.
    assert runner_processes(cli.runtime_dir)
    assert cli.run("sessions", "destroy", "nb").returncode == 0
    assert not runner_processes(cli.runtime_dir)


def test_files_go_in_and_the_runner_exits_when_idle(cli: Cli, tmp_path: Path) -> None:
    data = tmp_path / "data.csv"
    data.write_text("a,b\n1,2\n")
    env = {"SANDCELL_IDLE_TIMEOUT_S": "4"}
    result = cli.run(
        "run",
        "--session",
        "idle",
        "--file",
        str(data),
        "import pandas as pd\npd.read_csv('data.csv').shape",
        env=env,
    )
    assert (result.returncode, result.stdout) == (0, "(1, 2)\n"), result.stderr
    assert runner_processes(cli.runtime_dir)
    # Idle past SANDCELL_IDLE_TIMEOUT_S, the runner ends itself; the next call
    # restores the files, and the context says its variables are gone.
    deadline = time.monotonic() + 30
    while runner_processes(cli.runtime_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not runner_processes(cli.runtime_dir)
    lost = cli.run("run", "--session", "idle", "pd", env=env)
    assert lost.returncode == 2, lost.stderr
    assert "context_lost" in lost.stderr
    assert cli.run("sessions", "destroy", "idle").returncode == 0
