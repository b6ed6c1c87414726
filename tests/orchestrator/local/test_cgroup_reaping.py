"""The local provider reaps the cgroups of a runner it had to kill (issue 14, item 9)."""

from __future__ import annotations

import json
import os
import signal

from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_protocol import ExecuteRequest
from sandcell_runner.jail.cgroup_reaper import instance_key
from sandcell_runner.jail.cgroups import CGROUP_ROOT, V1_CONTROLLERS
from tests.fixtures.paths import traversable_dir


def _folders(key: str) -> int:
    count = 0
    for top in (
        *(CGROUP_ROOT / c / "sandcell" / key for c in V1_CONTROLLERS),
        CGROUP_ROOT / "sandcell" / key,
    ):
        if top.is_dir():
            count += 1 + sum(1 for child in top.iterdir() if child.is_dir())
    return count


async def test_destroying_a_killed_runner_removes_its_cgroups() -> None:
    """A runner that died by SIGKILL (a crash, an OOM kill of the runner) leaves its job
    cgroups; destroy removes them: no folder of it is left."""
    with traversable_dir("reap-") as root:
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
        try:
            handle = await provider.create(SandboxSpec())
            result = await handle.runner.execute(ExecuteRequest(language="bash", code="echo hi"))
            assert result.stdout == "hi\n"
            runner_root = root / "rt" / handle.sandbox_id
            key = instance_key(runner_root / "workspaces")
            assert _folders(key) > 0
            pid = json.loads((runner_root / "sandbox.json").read_text())["pid"]
            os.killpg(pid, signal.SIGKILL)
            await handle.runner.close()
            await provider.destroy(handle.sandbox_id)
            assert _folders(key) == 0
        finally:
            await provider.close()
