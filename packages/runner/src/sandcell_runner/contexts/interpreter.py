"""One context's interpreter: the driver running in its own long-lived jail.

Started through ``Jail.launch`` like a session's background process (same pinned
UID, cgroup limits, seccomp policy, session network namespace, workspace as the
working directory). Commands go to the driver's stdin; its frames come back on
its stdout (``framing.py``). A run ends with the driver's ``end`` frame, or with
the driver's death: a memory kill (the cgroup says so) is ``memory_limit``,
anything else ``context_lost``; either way the interpreter is gone.

A run past its deadline gets SIGINT (sent to the driver's own pid: nsjail repeats
a forwarded signal every second until its job ends) and, if it has not ended
within the grace, the whole jail is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandcell_protocol.contexts import (
    MIME_TYPES,
    ContextEndEvent,
    ContextErrorEvent,
    ContextEvent,
    ContextResultEvent,
    ContextStatus,
    ContextStderrEvent,
    ContextStdoutEvent,
)

from ..jail.launched import LaunchedJob, LaunchOutcome
from ..jail.nsjail import Jail
from ..jail.spec import JobSpec
from . import framing

log = logging.getLogger(__name__)

EventCallback = Callable[[ContextEvent], None]

_MAX_FRAME_BYTES = 64 * 1024 * 1024
"""A frame holds one result (a PNG of a big figure fits many times over)."""
_STOP_S = 2.0
_MIME_SET = frozenset(MIME_TYPES)


class InterpreterStartError(Exception):
    """The driver did not come up (the message carries what it printed)."""


@dataclass(frozen=True, slots=True)
class OutputCaps:
    """What one run may send back before it is interrupted (``output_limit``)."""

    stdout_bytes: int
    stderr_bytes: int
    result_bytes: int


@dataclass(slots=True)
class _Run:
    on_event: EventCallback
    caps: OutputCaps
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    result_bytes: int = 0
    limited: bool = False
    end: framing.End | None = None


class Interpreter:
    """A running driver: ``run`` one cell at a time, ``interrupt``, ``close``."""

    def __init__(self, job: LaunchedJob, cmd_fd: int, evt_fd: int, *, jailed: bool) -> None:
        self._job = job
        self._cmd_fd = cmd_fd
        self._evt_fd = evt_fd
        self._jailed = jailed
        self._reader = framing.FrameReader(max_frame_bytes=_MAX_FRAME_BYTES)
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._ended = asyncio.Event()
        self._run: _Run | None = None
        self._run_done = asyncio.Event()
        self._pid: int | None = None
        self.outcome: LaunchOutcome | None = None
        self.broken: str | None = None
        """Why the driver's stream was given up (an invalid frame)."""
        os.set_blocking(evt_fd, False)
        os.set_blocking(cmd_fd, False)
        self._loop.add_reader(evt_fd, self._on_readable)
        self._monitor = asyncio.create_task(self._watch(), name="sandcell-context")

    @classmethod
    async def start(cls, jail: Jail, spec: JobSpec, *, ready_timeout_s: float) -> Interpreter:
        """Launch the driver described by ``spec`` and wait for its ``ready`` frame."""
        cmd_r, cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        try:
            job = await jail.launch(spec, stdin_fd=cmd_r, output_fd=evt_w)
        except BaseException:
            for fd in (cmd_w, evt_r):
                os.close(fd)
            raise
        finally:
            os.close(cmd_r)
            os.close(evt_w)
        interpreter = cls(job, cmd_w, evt_r, jailed=jail.jailed)
        try:
            await interpreter._wait_ready(ready_timeout_s)
        except BaseException:
            await interpreter.close()
            raise
        return interpreter

    async def _wait_ready(self, timeout_s: float) -> None:
        ready = asyncio.ensure_future(self._ready.wait())
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({ready, ended}, timeout=timeout_s, return_when="FIRST_COMPLETED")
        finally:
            ready.cancel()
            ended.cancel()
        if not self._ready.is_set():
            said = self._reader.pending_text().strip() or self.broken or ""
            if self.outcome is not None and self.outcome.jail_log:
                said = (said + "\n" + self.outcome.jail_log[-2000:]).strip()
            raise InterpreterStartError(f"the interpreter did not start: {said[-4000:]}")
        self._pid = await asyncio.to_thread(_driver_pid, self._job.pid, jailed=self._jailed)

    @property
    def alive(self) -> bool:
        return not self._ended.is_set()

    @property
    def pid(self) -> int | None:
        """The driver's pid on the host (what ``interrupt`` signals)."""
        return self._pid

    # -- reading ----------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            data = os.read(self._evt_fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._loop.remove_reader(self._evt_fd)
            return
        if self.broken is not None:
            return
        try:
            frames = self._reader.feed(data)
        except framing.FrameError as exc:
            self.broken = str(exc)
            log.warning("context driver sent an invalid frame; killing it: %s", exc)
            self._job.kill()
            return
        for frame in frames:
            self._dispatch(frame)

    def _dispatch(self, frame: framing.Frame) -> None:
        if isinstance(frame, framing.Ready):
            self._ready.set()
            return
        run = self._run
        if run is None or run.end is not None:
            return  # a background thread's output between runs: nobody asked for it
        if isinstance(frame, framing.End):
            run.end = frame
            self._run_done.set()
        elif isinstance(frame, framing.Output | framing.ErrorOutput):
            self._output(run, frame)
        elif isinstance(frame, framing.Result):
            size = sum(len(str(value)) for value in frame.data.values())
            run.result_bytes += size
            if run.result_bytes > run.caps.result_bytes:
                self._over_cap(run)
                return
            data = {k: v for k, v in frame.data.items() if k in _MIME_SET}
            run.on_event(ContextResultEvent(data=data, is_main_result=frame.main))  # type: ignore[arg-type]
        else:
            run.on_event(
                ContextErrorEvent(name=frame.name, value=frame.value, traceback=frame.traceback)
            )

    def _output(self, run: _Run, frame: framing.Output | framing.ErrorOutput) -> None:
        is_out = isinstance(frame, framing.Output)
        used = run.stdout_bytes if is_out else run.stderr_bytes
        cap = run.caps.stdout_bytes if is_out else run.caps.stderr_bytes
        data = frame.data
        room = cap - used
        if room <= 0:
            self._over_cap(run)
            return
        encoded = data.encode("utf-8", "replace")
        if len(encoded) > room:
            data = encoded[:room].decode("utf-8", "ignore")
            self._over_cap(run)
        if is_out:
            run.stdout_bytes += len(encoded)
            run.on_event(ContextStdoutEvent(data=data))
        else:
            run.stderr_bytes += len(encoded)
            run.on_event(ContextStderrEvent(data=data))

    def _over_cap(self, run: _Run) -> None:
        if not run.limited:
            run.limited = True
            self._signal(signal.SIGINT)

    async def _watch(self) -> None:
        try:
            self.outcome = await self._job.wait()
        finally:
            # The driver is gone: what it wrote last is still in the pipe.
            with contextlib.suppress(OSError):
                while chunk := os.read(self._evt_fd, 1 << 20):
                    if self.broken is None:
                        try:
                            for frame in self._reader.feed(chunk):
                                self._dispatch(frame)
                        except framing.FrameError as exc:
                            self.broken = str(exc)
            self._loop.remove_reader(self._evt_fd)
            self._ended.set()
            self._run_done.set()

    # -- running ----------------------------------------------------------------------

    async def run(
        self,
        code: str,
        *,
        env: dict[str, str],
        timeout_s: float,
        grace_s: float,
        caps: OutputCaps,
        on_event: EventCallback,
    ) -> ContextEndEvent:
        """Run one cell; its events go to ``on_event``, the returned end event last."""
        started = time.monotonic()
        run = _Run(on_event=on_event, caps=caps)
        self._run = run
        self._run_done.clear()
        timed_out = False
        try:
            await self._send(framing.encode_command({"op": "run", "code": code, "env": env}))
            if not await self._wait_done(timeout_s):
                timed_out = True
                self._signal(signal.SIGINT)
                if not await self._wait_done(grace_s):
                    self.kill()
                    await self._ended.wait()
                else:
                    # The cell stopped; what it forked may not have (a fork bomb's copies).
                    await self._send(framing.encode_command({"op": "reap"}))
        except BaseException:
            # A cancelled request must not leave a cell running behind the next one.
            self.kill()
            raise
        finally:
            self._run = None
        wall_ms = int((time.monotonic() - started) * 1000)
        return self._end_event(run, timed_out=timed_out, wall_ms=wall_ms)

    def _end_event(self, run: _Run, *, timed_out: bool, wall_ms: int) -> ContextEndEvent:
        end = run.end
        lost = end is None
        message: str | None = None
        if timed_out:
            status = ContextStatus.TIMEOUT
            message = "timed out; interrupted" if not lost else "timed out; interpreter killed"
        elif lost:
            oom = self.outcome is not None and self.outcome.oom_killed
            status = ContextStatus.MEMORY_LIMIT if oom else ContextStatus.CONTEXT_LOST
            message = self.lost_reason()
        elif run.limited:
            status = ContextStatus.OUTPUT_LIMIT
            message = "output limit reached; interrupted"
        elif end is not None and end.status == "error":
            status = ContextStatus.ERROR
        else:
            status = ContextStatus.OK
        return ContextEndEvent(
            status=status,
            execution_count=max(0, end.count) if end is not None else 0,
            wall_ms=wall_ms,
            cpu_ms=max(0, end.cpu_ms) if end is not None else 0,
            context_lost=lost,
            message=message,
        )

    def lost_reason(self) -> str:
        """Why the interpreter is gone, in words."""
        if self.broken is not None:
            return "the interpreter's output stream was corrupted; it was killed"
        outcome = self.outcome
        if outcome is None:
            return "the interpreter was killed"
        if outcome.oom_killed:
            return "the interpreter was killed: memory limit reached"
        if outcome.signal is not None:
            return f"the interpreter was killed by {outcome.signal}"
        return f"the interpreter exited (exit code {outcome.exit_code})"

    async def _wait_done(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._run_done.wait()
            return True
        return False

    async def _send(self, frame: bytes) -> None:
        view = memoryview(frame)
        while view:
            if not self.alive:
                return
            try:
                view = view[os.write(self._cmd_fd, view) :]
            except BlockingIOError:
                writable = self._loop.create_future()
                self._loop.add_writer(self._cmd_fd, writable.set_result, None)
                try:
                    done = asyncio.ensure_future(self._ended.wait())
                    await asyncio.wait({writable, done}, return_when="FIRST_COMPLETED")
                    done.cancel()
                finally:
                    self._loop.remove_writer(self._cmd_fd)
            except (BrokenPipeError, OSError):
                return

    # -- control ----------------------------------------------------------------------

    def interrupt(self) -> bool:
        """SIGINT the running cell; False when no cell runs."""
        if self._run is None or not self.alive:
            return False
        self._signal(signal.SIGINT)
        return True

    def _signal(self, signum: int) -> None:
        if self._pid is None or not self.alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self._pid, signum)

    def kill(self) -> None:
        """Kill the jail and everything in it (idempotent)."""
        if self.alive:
            self._job.kill()

    async def close(self) -> None:
        """End the driver (stdin closed, then killed after a short wait); idempotent."""
        if self._cmd_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._cmd_fd)
            self._cmd_fd = -1
        if self.alive:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_STOP_S):
                    await self._ended.wait()
            self.kill()
        with contextlib.suppress(BaseException):
            await self._monitor
        with contextlib.suppress(OSError):
            os.close(self._evt_fd)


def _driver_pid(jail_pid: int, *, jailed: bool) -> int | None:
    """The driver's host pid: nsjail's one child when jailed, the process itself when not."""
    if not jailed:
        return jail_pid
    children = Path(f"/proc/{jail_pid}/task/{jail_pid}/children")
    with contextlib.suppress(OSError, ValueError):
        pids = [int(p) for p in children.read_text().split()]
        if pids:
            return pids[0]
    # Without CONFIG_PROC_CHILDREN: the process whose parent is nsjail.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == jail_pid:
                return int(entry.name)
    return None


__all__ = ["EventCallback", "Interpreter", "InterpreterStartError", "OutputCaps"]
