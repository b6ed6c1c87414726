"""The local provider (the embedded default): each sandbox is a ``sandcell-runner`` process.

A runner listens on loopback with a random port and a random per-sandbox token,
keeps its own workspace root and input cache, and has sessions enabled. Its
process group is killed by ``destroy``. Each runner's facts (pid, port, token)
sit in a 0600 ``sandbox.json`` so ``connect`` works from another orchestrator
process (each ``sandcell exec`` is one). Runners get ``PR_SET_PDEATHSIG=SIGTERM``:
an orchestrator that dies takes its runners with it, gracefully enough for them
to unmount their workspaces.

``pause_resume`` is False: the manager suspends a session by checkpointing its
runner into the snapshot store and destroying the process, and resumes it in a
new runner it restores into. An optional warm pool of pre-started runners hides the Python
start-up from ``create``; without one, runners are forked from a pre-imported zygote
(``local_zygote.py``) once it is up, which hides most of it.

This module launches runners, keeps the pool and destroys sandboxes; beside it,
``local_start.py`` starts a runner's process (its root, listener and token),
``local_state.py`` keeps a runner's facts (``sandbox.json``) and tells whether its
pid still names it, ``local_ready.py`` waits for a launched runner to answer, and
``local_reaping.py`` stops runners and reaps their processes, cgroups and roots.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

import anyio

from ..errors import SandboxNotFoundError, SandboxUnavailableError
from ..handle import SandboxHandle
from ..runner.answers import DEFAULT_CAPS, AnswerCaps
from ..runner.client import RunnerClient
from ..to_the_end import to_the_end
from .base import (
    SESSION_LABEL,
    SandboxCapabilities,
    SandboxSpec,
    sandbox_session_id,
)
from .local_ready import runner_log_tail, wait_ready_unless_exited
from .local_reaping import discard_launch, reap_in_background, stop_runner
from .local_settings import LocalSettings, default_runtime_dir
from .local_start import RunnerStarts, base_env, undo_start
from .local_state import LocalRunner, forget_state, read_state, runner_alive, write_state
from .local_zygote import ForkedRunner, RunnerZygote
from .runner_roots import detach_runner_mounts, reap_runner_cgroups, remove_runner_root

__all__ = ["LocalProvider", "LocalSettings", "default_runtime_dir"]

log = logging.getLogger(__name__)


class LocalProvider:
    """Sandboxes as local runner processes."""

    name = "local"
    capabilities = SandboxCapabilities(pause_resume=False)

    def __init__(self, settings: LocalSettings, *, answer_caps: AnswerCaps = DEFAULT_CAPS) -> None:
        self._settings = settings
        self._answer_caps = answer_caps
        self._pool: list[LocalRunner] = []
        self._fill: asyncio.Task[None] | None = None
        self._closed = False
        # Detached runners outlive this process, which then launches one or two: a
        # zygote's imports would only add to that.
        self._zygote = (
            RunnerZygote(python=settings.python, env=base_env(settings.runner_env))
            if settings.zygote and settings.detached_idle_s is None
            else None
        )
        self._starts = RunnerStarts(settings, zygote=self._zygote)
        settings.runtime_dir.mkdir(parents=True, exist_ok=True)
        for directory in (settings.runtime_dir, *settings.runtime_dir.parents):
            if directory == Path("/"):
                break
            if not os.stat(directory).st_mode & 0o001 and os.geteuid() == 0:
                os.chmod(directory, os.stat(directory).st_mode | 0o001)

    # -- launching ------------------------------------------------------------

    async def _launch(self, *, plain: bool = False) -> LocalRunner:
        # The root's mkdir and the zygote's fork run in threads, which a cancelled
        # caller (a launch budget run out, as after a SIGSTOP) cannot stop: each went on
        # to leave a root, and a forked runner nobody knew, listening until the zygote
        # died. The start is therefore waited for to its end, then undone.
        start = asyncio.ensure_future(self._starts.start(plain=plain))
        try:
            runner, process = await asyncio.shield(start)
        except asyncio.CancelledError:
            await undo_start(start, python=self._settings.python)
            raise
        client = RunnerClient(runner.url, token=runner.token, caps=self._answer_caps)
        # Until ``create`` returns its handle nobody else knows this runner: whatever
        # ends the launch from here on (a cancelled caller, a timed-out launch budget)
        # must stop it, the state write included, or it runs with no one to stop it.
        try:
            try:
                await wait_ready_unless_exited(
                    client, process, timeout_s=self._settings.ready_timeout_s
                )
            finally:
                with anyio.CancelScope(shield=True):
                    await client.close()
            await _write_state_to_the_end(runner)
        except SandboxUnavailableError:
            said = runner_log_tail(runner.root)
            await to_the_end(discard_launch(runner, process, python=self._settings.python))
            raise SandboxUnavailableError(f"local runner did not become ready: {said}") from None
        except BaseException:
            # To its end: an anyio shield lets a second native cancellation through,
            # which left the runner running and its root on disk.
            await to_the_end(discard_launch(runner, process, python=self._settings.python))
            raise
        if isinstance(process, ForkedRunner):
            process.close()  # the zygote reaps it
        else:
            reap_in_background(process)
        return runner

    def _handle(self, runner: LocalRunner, session_id: str | None) -> SandboxHandle:
        return SandboxHandle(
            sandbox_id=runner.sandbox_id,
            provider=self.name,
            runner=RunnerClient(runner.url, token=runner.token, caps=self._answer_caps),
            session_id=session_id or sandbox_session_id(runner.sandbox_id),
            endpoint=runner.url,
        )

    async def _refill(self) -> None:
        while not self._closed and len(self._pool) < self._settings.pool_size:
            try:
                self._pool.append(await self._launch())
            except SandboxUnavailableError as exc:
                log.warning("warm pool refill failed: %s", exc)
                return

    def _schedule_refill(self) -> None:
        if self._settings.pool_size and (self._fill is None or self._fill.done()):
            self._fill = asyncio.create_task(self._refill(), name="sandcell-local-pool")

    async def _pooled(self) -> LocalRunner | None:
        """A live pooled runner; dead ones (crashed, OOM-killed, or idle-exited when
        detached) are destroyed, not handed out to fail the session's first request."""
        while self._pool:
            runner = self._pool.pop(0)
            if runner_alive(runner):
                return runner
            log.warning("warm pool: runner %s had exited; destroying it", runner.sandbox_id)
            await self.destroy(runner.sandbox_id)
        return None

    async def start_pool(self) -> None:
        """Fill the warm pool now (``create`` also refills it in the background)."""
        await self._refill()

    # -- SandboxProvider ----------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        runner = await self._pooled() or await self._launch()
        self._schedule_refill()
        session_id = spec.labels.get(SESSION_LABEL)
        if session_id is not None:
            # Recorded so that connect() from another process binds to the same session.
            runner = dataclasses.replace(runner, session_id=session_id)
            try:
                await _write_state_to_the_end(runner)
            except BaseException:
                # Cancelled before its handle reached anyone: nobody else would stop it.
                await to_the_end(self.destroy(runner.sandbox_id))
                raise
        return self._handle(runner, session_id)

    async def connect(self, sandbox_id: str) -> SandboxHandle:
        runner = await asyncio.to_thread(self._read_state, sandbox_id)
        if runner is None or not runner_alive(runner):
            raise SandboxNotFoundError(f"local sandbox {sandbox_id} is gone")
        return self._handle(runner, runner.session_id)

    async def destroy(self, sandbox_id: str) -> None:
        runner = await asyncio.to_thread(self._read_state, sandbox_id)
        root = self._root(sandbox_id)
        clean = True
        if runner is not None:
            clean = await stop_runner(runner, python=self._settings.python)
        elif root is not None and await asyncio.to_thread(root.is_dir):
            # No state: the runner's worker died while launching it (the state is written
            # once the runner answers), and the runner went too, maybe after pre-creating
            # its job-pool cgroups. Only the sweeper destroys such a root, past a launch.
            clean = await asyncio.to_thread(reap_runner_cgroups, self._settings.python, root)
        if root is None:
            return
        if clean:
            await asyncio.to_thread(remove_runner_root, root)
        else:
            # Its cgroups are still there (a zombie still counted in them, say). The
            # root's name is what finds them, so the root stays for the sweeper's next
            # round (``dead_sandboxes``); its tmpfs mounts go now, and so does its state:
            # the runner was signalled, and its pid, by a later round maybe another
            # process's, must not be signalled again (a state written before start times
            # were recorded cannot tell another runner from this one).
            await asyncio.to_thread(forget_state, root)
            await asyncio.to_thread(detach_runner_mounts, root)

    async def close(self) -> None:
        """Stop refilling, destroy pooled (never handed out) runners, stop the zygote."""
        self._closed = True
        if self._zygote is not None:
            await self._zygote.aclose()
        if self._fill is not None:
            self._fill.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._fill
        pooled, self._pool = self._pool, []
        for runner in pooled:
            await self.destroy(runner.sandbox_id)

    # -- state ----------------------------------------------------------------

    async def dead_sandboxes(self) -> dict[str, float]:
        """The runtime directory's sandboxes that serve no one (``Remains``), by age: the
        roots whose runner is gone, and the live runners of a session (only a record can
        still claim one: the record may have gone with a wiped Redis, and nothing else
        would ever stop it), as Docker's running containers of a session are. A live
        runner of no session (pooled, or a stateless run's) is left alone."""
        return await asyncio.to_thread(self._dead)

    def _dead(self) -> dict[str, float]:
        now = time.time()
        found = {}
        with contextlib.suppress(OSError):
            for entry in self._settings.runtime_dir.iterdir():
                if self._root(entry.name) is None:
                    continue
                runner = self._read_state(entry.name)
                aged = entry
                if runner is not None and runner_alive(runner):
                    if runner.session_id is None:
                        continue
                    # Aged from its session's claim (``create`` writes the state then),
                    # not the root's making: a pooled runner is older than its session.
                    aged = entry / "sandbox.json"
                with contextlib.suppress(OSError):
                    found[entry.name] = max(0.0, now - aged.stat().st_mtime)
        return found

    def _root(self, sandbox_id: str) -> Path | None:
        if not sandbox_id.startswith("local-") or not sandbox_id[6:].isalnum():
            return None
        return self._settings.runtime_dir / sandbox_id

    def _read_state(self, sandbox_id: str) -> LocalRunner | None:
        root = self._root(sandbox_id)
        return None if root is None else read_state(sandbox_id, root)


async def _write_state_to_the_end(runner: LocalRunner) -> None:
    """``write_state`` in a thread, awaited to its end even when the caller is cancelled
    (the cancellation is passed on after): a thread cannot be stopped, and a write that
    landed after the runner's stop would bring back the state of a stopped runner."""
    await to_the_end(asyncio.to_thread(write_state, runner))
