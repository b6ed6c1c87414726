"""A create cancelled before its handle reached anyone leaves no runner, no root, behind.

Until ``create`` returns the handle nobody else knows the runner. Its last steps
write the runner's state (``sandbox.json``, and again with the session's id): a
caller cancelled there (a timed-out launch budget, a client gone) used to leave a
ready runner running with no one to stop it. Before that, the root is made and the
runner forked in threads, which a cancellation cannot stop either. The write, or the
fork, is held up here, in its thread, until the cancellation has been sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandcell_orchestrator.providers import local, local_reaping
from sandcell_orchestrator.providers.base import SESSION_LABEL, SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.providers.local_state import LocalRunner
from sandcell_orchestrator.providers.local_zygote import RunnerZygote
from tests.fixtures.cancelling import cancel_twice
from tests.fixtures.paths import traversable_dir

from .test_zygote import _forked


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


async def test_a_create_cancelled_while_the_zygote_forks_leaves_no_runner_and_no_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The zygote forks in a thread, which the cancellation cannot stop (a launch budget
    that ran out while the worker was stopped, say): the fork went on and its runner
    listened, unknown, until the zygote died, and the root stayed behind."""
    entered = threading.Event()
    release = threading.Event()
    forked = threading.Event()
    real_fork = RunnerZygote._fork

    def held(self: RunnerZygote, env: dict[str, str], fds: tuple[int, int, int]) -> Any:
        entered.set()
        release.wait(60)
        try:
            return real_fork(self, env, fds)
        finally:
            forked.set()

    with traversable_dir("cancel-") as root:
        runtime = root / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        made: list[str] = []
        try:
            await (await _forked(provider, runtime, made)).close()  # the zygote is up
            for sandbox_id in made:
                await provider.destroy(sandbox_id)
            assert list(runtime.iterdir()) == []
            monkeypatch.setattr(RunnerZygote, "_fork", held)
            create = asyncio.create_task(provider.create(SandboxSpec()))
            async with asyncio.timeout(60):
                while not entered.is_set():
                    await asyncio.sleep(0.02)
            create.cancel()
            await asyncio.sleep(0.2)  # the cancellation has reached the create
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await create
            assert await asyncio.to_thread(forked.wait, 60)
            await asyncio.sleep(0.5)  # a runner forked by then has started
            assert list(runtime.iterdir()) == []
            # The fork had the launch's descriptors, which the cancelled launch used to
            # close under it: the zygote then failed and was stopped.
            assert provider._zygote is not None
            assert provider._zygote.pid is not None, "the cancellation cost the zygote"
            # A forked runner's /proc environ is the zygote's: it is found as its child.
            zygote = psutil.Process(provider._zygote.pid)
            alive = [p for p in zygote.children() if p.status() != psutil.STATUS_ZOMBIE]
            assert alive == []
        finally:
            release.set()
            await provider.close()


async def test_a_create_cancelled_again_while_it_discards_its_runner_still_discards_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled while its runner was starting, the launch discards it: under an anyio
    shield, which a second native cancellation (a stream's generator and the turn it
    awaits, both cancelled by a gone client) passes, and the runner ran on, its root
    left. The discard's stop is held here until the second cancellation has come."""
    starting = asyncio.Event()
    stopping = asyncio.Event()
    go_on = asyncio.Event()
    real_stop = local_reaping.stop_runner

    async def never_ready(*_: Any, **__: Any) -> None:
        starting.set()
        await asyncio.Event().wait()

    async def held_stop(runner: LocalRunner, *, python: str) -> bool:
        stopping.set()
        await go_on.wait()
        return await real_stop(runner, python=python)

    monkeypatch.setattr(local, "wait_ready_unless_exited", never_ready)
    monkeypatch.setattr(local_reaping, "stop_runner", held_stop)
    with traversable_dir("cancel-") as root:
        runtime = root / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime, zygote=False))
        try:
            create = asyncio.create_task(provider.create(SandboxSpec()))
            await cancel_twice(create, first=starting, cleaning=stopping, go_on=go_on)
            assert _runners_under(runtime) == [], "the runner was left running"
            assert list(runtime.iterdir()) == [], "the root was left"
        finally:
            go_on.set()
            for pid in _runners_under(runtime):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            await provider.close()
