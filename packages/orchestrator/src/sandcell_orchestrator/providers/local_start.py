"""``RunnerStarts``: starting a local runner's process (not yet answering).

Each start makes a new root, binds the runner's loopback listener, puts its token
on a pipe, and forks the runner from the zygote (``local_zygote.py``) or, while none
is ready, spawns it plainly; ``undo_start`` stops one whose caller was cancelled.
``local.py`` waits for the runner to answer and keeps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import secrets
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..errors import SandboxUnavailableError
from ..to_the_end import to_the_end
from .local_reaping import discard_launch
from .local_settings import LocalSettings
from .local_state import LaunchedProcess, LocalRunner, start_ticks
from .local_zygote import ForkedRunner, RunnerZygote, ZygoteError
from .runner_roots import remove_runner_root

__all__ = ["RunnerStarts", "base_env", "undo_start"]

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class RunnerStarts:
    """Starts runners under ``settings.runtime_dir``, forked from ``zygote`` when up."""

    def __init__(self, settings: LocalSettings, *, zygote: RunnerZygote | None) -> None:
        self._settings = settings
        self._zygote = zygote

    async def start(self, *, plain: bool) -> tuple[LocalRunner, LaunchedProcess]:
        """A new root and its runner's process, started (not yet answering)."""
        sandbox_id = "local-" + secrets.token_hex(8)
        root = self._settings.runtime_dir / sandbox_id
        await asyncio.to_thread(root.mkdir, 0o711)
        token = secrets.token_urlsafe(32)
        # Bound here and inherited: no port to race another process for, and the
        # readiness probe waits in the listen backlog instead of polling a port that
        # refuses until the runner has imported itself (that polling was ~60 CPU-ms
        # of this process per cold session, taken from the runner's own start).
        listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        port = listener.getsockname()[1]
        env = {
            **base_env(self._settings.runner_env),
            "SANDCELL_RUNNER_HOST": "127.0.0.1",
            "SANDCELL_RUNNER_PORT": str(port),
            "SANDCELL_RUNNER_LISTEN_FD": str(listener.fileno()),
            "SANDCELL_WORKSPACE_ROOT": str(root / "workspaces"),
            "SANDCELL_INPUT_CACHE_DIR": str(root / "input-cache"),
            "SANDCELL_RUNNER_SESSIONS": "1",
        }
        if self._settings.detached_idle_s is not None:
            env["SANDCELL_RUNNER_IDLE_EXIT_S"] = str(self._settings.detached_idle_s)
        process: LaunchedProcess | None = None
        try:
            process = None if plain else await self._fork(env, root, token, listener)
            if process is None:
                process = self._spawn(env, root, token, listener)
        except ZygoteError as exc:
            # Lost mid-request, the zygote may have forked a child holding this root,
            # listener and token before it went: start afresh rather than share them.
            log.warning("%s; launching plainly", exc)
            listener.close()
            await asyncio.to_thread(remove_runner_root, root)
            return await self.start(plain=True)
        except OSError as exc:  # the configured interpreter cannot be run
            await asyncio.to_thread(remove_runner_root, root)
            raise SandboxUnavailableError(f"local runner could not start: {exc}") from None
        finally:
            listener.close()  # the runner's copy is the only one: its exit refuses clients
        # Read now: an unreaped child's pid cannot have been reused yet. A forked one is
        # reaped by the zygote: its pidfd says whether the pid still names it.
        started = start_ticks(process.pid)
        if isinstance(process, ForkedRunner) and process.poll() is not None:
            started = -1  # matches no process: nothing signals whoever has the pid now
        return LocalRunner(sandbox_id, process.pid, port, token, root, started=started), process

    async def _fork(
        self, env: dict[str, str], root: Path, token: str, listener: socket.socket
    ) -> ForkedRunner | None:
        """The runner forked from the zygote; None (launch plainly) while none is ready.

        The first launch starts the zygote and does not wait for it.
        """
        if self._zygote is None or not self._zygote.fits(env):
            return None
        self._zygote.start()  # from the loop's thread, like a plain launch; no-op if up
        with _token_pipe(token) as read_fd, (root / "runner.log").open("ab") as log_file:
            return await self._zygote.fork(
                env, log_fd=log_file.fileno(), token_fd=read_fd, listener_fd=listener.fileno()
            )

    def _spawn(
        self, env: dict[str, str], root: Path, token: str, listener: socket.socket
    ) -> subprocess.Popen[bytes]:
        # Forked from the event loop's thread on purpose: PR_SET_PDEATHSIG follows the
        # forking *thread*, and worker threads come and go. The fork costs ~1 ms.
        with _token_pipe(token) as read_fd, (root / "runner.log").open("ab") as log_file:
            return subprocess.Popen(
                [self._settings.python, "-m", "sandcell_runner"],
                env={**env, "SANDCELL_RUNNER_TOKEN_FILE": f"/dev/fd/{read_fd}"},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # A detached runner outlives this process and ends itself when idle.
                preexec_fn=_die_with_parent if self._settings.detached_idle_s is None else None,
                pass_fds=(read_fd, listener.fileno()),
            )


async def undo_start(
    start: asyncio.Future[tuple[LocalRunner, LaunchedProcess]], *, python: str
) -> None:
    """Wait for a start whose caller was cancelled, then stop its runner and remove its
    root (a start that failed by itself removed its root already)."""
    while not start.done():
        # Cancelled again meanwhile: the caller is leaving anyway, and what the start
        # makes must still go.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({start})
    if start.cancelled() or start.exception() is not None:
        return
    runner, process = start.result()
    await to_the_end(discard_launch(runner, process, python=python))


@contextlib.contextmanager
def _token_pipe(token: str) -> Iterator[int]:
    """The read end of a pipe holding ``token``, closed on exit (the runner has its copy).

    The token goes on a pipe, not into the runner's environment block (which
    /proc/<pid>/environ shows for its whole life; given one, it re-execs itself).
    """
    read_fd, write_fd = os.pipe()
    try:
        try:
            os.write(write_fd, token.encode())  # ~43 bytes: never blocks
        finally:
            os.close(write_fd)
        yield read_fd
    finally:
        os.close(read_fd)


def base_env(runner_env: Mapping[str, str]) -> dict[str, str]:
    """What every runner gets before its own variables (the zygote's environment too)."""
    return {**runner_env, "PATH": runner_env.get("PATH", os.environ.get("PATH", "/usr/bin:/bin"))}


def _die_with_parent() -> None:
    _libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
