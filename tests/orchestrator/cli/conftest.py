"""Fixtures for the ``sandcell`` CLI and service tests: a fresh ``SANDCELL_HOME`` each.

The CLI runs as real subprocesses (each ``sandcell exec`` is its own process,
which is the point: sessions cross processes through the snapshot store), and
the service runs in-process under a real uvicorn. Both launch real runners
through the local provider, under a runtime directory job UIDs can traverse.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from sandcell_orchestrator.providers.runner_roots import reap_runner_cgroups
from sandcell_orchestrator.testing import clean_environ, sandbox_processes
from tests.fixtures.paths import traversable_dir

__all__ = ["Cli", "clean_environ", "runner_processes", "stop_leftovers"]

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "sandcell"


runner_processes = sandbox_processes
"""Live processes started for sandboxes under a runtime directory (runners and jails)."""


def stop_leftovers(runtime_dir: Path) -> list[psutil.Process]:
    """Kill what a test left under ``runtime_dir`` (only ours) and reap the cgroups of
    every runner root there; returns the processes it killed.

    A SIGKILLed runner cannot remove its job cgroups, and with a shared registry a
    worker leaves its runners alive by design, so this kill is what ends them. Their
    roots go with the test's directory, and a root's name is what finds its cgroups:
    reaped now, or left empty under ``sandcell/`` until some later runner's reaper.
    """
    leftovers = runner_processes(runtime_dir)
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(leftovers, timeout=10)
    with contextlib.suppress(OSError):
        for root in sorted(runtime_dir.iterdir()):
            # The reaper skips a leased subtree: a runner still alive keeps its own.
            if root.is_dir():
                reap_runner_cgroups(sys.executable, root)
    return leftovers


@dataclass
class Cli:
    """Runs ``sandcell`` as a subprocess against one fresh ``SANDCELL_HOME``."""

    home: Path
    runtime_dir: Path
    env: dict[str, str]

    def command(self, *, script: bool = False) -> list[str]:
        """The argv that starts ``sandcell``: this interpreter's module, or scripts/sandcell."""
        return [str(SCRIPT)] if script else [sys.executable, "-m", "sandcell_orchestrator"]

    def run(
        self,
        *args: str,
        stdin: str | None = None,
        script: bool = False,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.command(script=script), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            cwd=cwd or self.home.parent,
            timeout=300,
            check=False,
        )

    def checkpoint_files(self, session_id: str) -> list[Path]:
        """The session's checkpoint objects in the snapshot directory (one per generation)."""
        return sorted((self.home / "snapshots" / "checkpoints" / session_id).glob("*"))


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """Where the local provider keeps runner roots; nothing may be left running there."""
    with traversable_dir("cli-") as base:
        path = base / "sandboxes"
        yield path
        leftovers = stop_leftovers(path)
        assert not leftovers, f"runner processes left behind: {leftovers}"


@pytest.fixture
def cli(tmp_path: Path, runtime_dir: Path) -> Cli:
    home = tmp_path / "home"
    env = clean_environ(SANDCELL_HOME=str(home), SANDCELL_LOCAL_RUNTIME_DIR=str(runtime_dir))
    return Cli(home=home, runtime_dir=runtime_dir, env=env)
