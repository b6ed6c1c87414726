"""The local provider's warm pool hands out live runners only."""

from __future__ import annotations

import os
import signal

import psutil

from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from tests.fixtures.paths import traversable_dir

from .test_pid_reuse import _state


async def test_a_pooled_runner_that_died_is_not_handed_out() -> None:
    """The warm pool's runner was killed while it waited (an OOM kill, say): ``create``
    destroys it and answers with a live runner, not a handle whose first request fails."""
    with traversable_dir("reuse-") as base:
        runtime = base / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime, pool_size=1))
        made: list[str] = []
        try:
            await provider.start_pool()
            (pooled,) = [path.name for path in runtime.iterdir()]
            pid = int(str(_state(runtime, pooled)["pid"]))
            process = psutil.Process(pid)  # before the kill: it may be reaped at once
            os.killpg(pid, signal.SIGKILL)
            process.wait(timeout=30)
            handle = await provider.create(SandboxSpec())
            made.append(handle.sandbox_id)
            assert handle.sandbox_id != pooled
            assert (await handle.runner.health()).status == "ok"
            await handle.runner.close()
            assert not (runtime / pooled).exists()
        finally:
            await provider.close()
            for sandbox_id in made:
                await provider.destroy(sandbox_id)
