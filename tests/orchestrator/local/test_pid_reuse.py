"""A sandbox's runner is its pid *and* that process's start time: a reused pid is not it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from sandcell_orchestrator.errors import SandboxNotFoundError
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from tests.fixtures.paths import traversable_dir


def _state(root: Path, sandbox_id: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((root / sandbox_id / "sandbox.json").read_text())
    return data


def _rewrite(root: Path, sandbox_id: str, **changes: object) -> None:
    path = root / sandbox_id / "sandbox.json"
    data = {**_state(root, sandbox_id), **changes}
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


async def test_a_dead_runners_pid_reused_by_another_runner_is_not_that_sandbox() -> None:
    """Sandbox A's runner died and its pid now names sandbox B's runner (pid reuse, here
    by rewriting A's recorded pid): A is gone to ``connect``, is a dead sandbox to the
    sweeper, and destroying it leaves B's runner running and answering."""
    with traversable_dir("reuse-") as base:
        runtime = base / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        made: list[str] = []
        try:
            a = await provider.create(SandboxSpec())
            made.append(a.sandbox_id)
            b = await provider.create(SandboxSpec())
            made.append(b.sandbox_id)
            a_pid = int(str(_state(runtime, a.sandbox_id)["pid"]))
            b_pid = int(str(_state(runtime, b.sandbox_id)["pid"]))
            assert (
                _state(runtime, a.sandbox_id)["started"] != _state(runtime, b.sandbox_id)["started"]
            )
            await a.runner.close()
            # Held before the kill: whoever reaps it may do so at once (a zygote's runner).
            a_process = psutil.Process(a_pid)
            os.killpg(a_pid, signal.SIGKILL)
            a_process.wait(timeout=30)
            _rewrite(runtime, a.sandbox_id, pid=b_pid)

            with pytest.raises(SandboxNotFoundError):
                await provider.connect(a.sandbox_id)
            assert a.sandbox_id in await provider.dead_sandboxes()
            await provider.destroy(a.sandbox_id)

            assert psutil.pid_exists(b_pid)
            again = await provider.connect(b.sandbox_id)
            assert (await again.runner.health()).status == "ok"
            await again.runner.close()
            await b.runner.close()
        finally:
            for sandbox_id in made:
                await provider.destroy(sandbox_id)
            await provider.close()


async def test_a_state_written_before_start_times_still_connects() -> None:
    """A ``sandbox.json`` from before start times were recorded (no ``started``) still
    names its live runner: the cmdline check alone decides, as it used to."""
    with traversable_dir("reuse-") as base:
        runtime = base / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        handle = await provider.create(SandboxSpec())
        try:
            await handle.runner.close()
            _rewrite(runtime, handle.sandbox_id, started=None)
            assert "started" not in _state(runtime, handle.sandbox_id)
            again = await provider.connect(handle.sandbox_id)
            assert (await again.runner.health()).status == "ok"
            await again.runner.close()
            assert handle.sandbox_id not in await provider.dead_sandboxes()
        finally:
            await provider.destroy(handle.sandbox_id)
            await provider.close()
