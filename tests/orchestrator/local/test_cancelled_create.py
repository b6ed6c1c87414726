"""A create cancelled after its runner answered leaves no runner behind.

Until ``create`` returns the handle nobody else knows the runner. Its last steps
write the runner's state (``sandbox.json``, and again with the session's id): a
caller cancelled there (a timed-out launch budget, a client gone) used to leave a
ready runner running with no one to stop it. The write is held up here, in its
thread, until the cancellation has been sent.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import psutil
import pytest

from sandcell_orchestrator.providers import local
from sandcell_orchestrator.providers.base import SESSION_LABEL, SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.providers.local_state import LocalRunner
from tests.fixtures.paths import traversable_dir


def _runners_under(runtime: Path) -> list[int]:
    found = []
    for process in psutil.process_iter(["pid", "environ"]):
        try:
            root = (process.info["environ"] or {}).get("SANDCELL_WORKSPACE_ROOT", "")
        except psutil.Error:
            continue
        if root.startswith(f"{runtime}/") and process.status() != psutil.STATUS_ZOMBIE:
            found.append(process.info["pid"])
    return found


@pytest.mark.parametrize(
    ("held_write", "what"), [(1, "the launch's state"), (2, "the session's state")]
)
async def test_a_create_cancelled_while_its_state_is_written_stops_the_runner(
    monkeypatch: pytest.MonkeyPatch, held_write: int, what: str
) -> None:
    writes = 0
    entered = threading.Event()
    release = threading.Event()
    real_write = local.write_state

    def held(runner: LocalRunner) -> None:
        nonlocal writes
        writes += 1
        if writes == held_write:
            entered.set()
            release.wait(60)
        real_write(runner)

    monkeypatch.setattr(local, "write_state", held)
    with traversable_dir("cancel-") as root:
        runtime = root / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        try:
            spec = SandboxSpec(labels={SESSION_LABEL: "s-cancelled"})
            create = asyncio.create_task(provider.create(spec))
            async with asyncio.timeout(120):
                while not entered.is_set():
                    await asyncio.sleep(0.02)
            assert _runners_under(runtime), "the runner answered before its state is written"
            create.cancel()
            await asyncio.sleep(0.2)  # the cancellation has reached the create
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await create
            assert _runners_under(runtime) == [], f"cancelled writing {what}"
            assert list(runtime.iterdir()) == []
        finally:
            release.set()
            await provider.close()
