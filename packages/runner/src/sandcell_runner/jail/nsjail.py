"""Runs one job under nsjail with hard limits; the only module that starts nsjail.

Each job gets its own nsjail configuration (rendered by ``nsjail_config.py``, written
into a memfd nsjail reads as ``/dev/fd/N``, so nothing touches disk) with new user,
pid, mount, ipc, uts, cgroup and network namespaces; the job's UID is mapped to the
same unprivileged UID outside. Memory and pids are limited by the job cgroup
(``cgroups.py``); wall time by the runner's own timer (so a timeout is known, not
guessed), with nsjail's ``time_limit`` as a backstop.

A session's jobs share one network namespace instead (``netns.py``): the spawner
child joins it and nsjail runs with ``clone_newnet: false``, so a dev server and a
later command meet on the session's own ``localhost`` and still reach nothing else.
``launch`` starts a long-running job (no wall time unless its caller keeps one)
that the caller signals and waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import heapq
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from sandcell_protocol.env_vars import env_bytes

from ..cancelling import to_thread_to_the_end
from ..errors import JailError
from ..languages import JOB_DIR, WORKSPACE_DIR
from .capture import DRAIN_INTERVAL_S, Capture, OutputCallback, discard, widen
from .cgroups import CgroupManager
from .job_cgroup import JobCgroup
from .launched import LaunchedJob
from .nsjail_config import MAX_CONFIG_BYTES, render_config
from .outcome import (
    JobOutcome,
    decode_status,
    job_peak_kib,
    job_status_from_log,
    launch_status,
    warnings_only,
)
from .spawner import ProcessSpawner, SpawnRequest
from .spec import JobLimits, JobSpec
from .stdin import sealed_memfd


class Jail:
    """Runs jobs under nsjail (or, for developer machines, unjailed)."""

    def __init__(
        self,
        *,
        nsjail: Path | None,
        cgroups: CgroupManager,
        spawner: ProcessSpawner,
        as_job_user: bool = True,
    ) -> None:
        self._nsjail = nsjail
        self._cgroups = cgroups
        self._spawner = spawner
        # nsjail itself runs as the job's UID (when root; see ``_spawn_request``).
        self._as_job_user = as_job_user and os.geteuid() == 0
        self._counter = 0
        # Pooled cgroup slots: a slot is held by one running job at a time. Keyed by
        # slot, not by job UID, because an unprivileged runner gives every job the
        # same UID, and two jobs in one cgroup would reset and kill each other.
        self._idle_slots: list[int] = []
        self._slots_made = 0
        self.netns_for: Callable[[Path], int | None] | None = None
        """Which network namespace a job in this workspace joins (the session's);
        set by the service. Jobs with ``network`` or an explicit ``netns_fd`` skip it."""
        self.egress_for: Callable[[JobSpec], JobSpec] | None = None
        """The job's egress (its namespace when it has none yet, proxy variables, resolver);
        set by the service, called for every job without ``network``."""

    @property
    def jailed(self) -> bool:
        return self._nsjail is not None

    def inside_paths(self, spec_workspace: Path, job_dir: Path) -> tuple[str, str]:
        """Where the workspace and job directory appear to the job."""
        if self.jailed:
            return WORKSPACE_DIR, JOB_DIR
        return str(spec_workspace), str(job_dir)

    def config_text(self, spec: JobSpec) -> str:
        """The nsjail configuration of one job (protobuf text format)."""
        return render_config(spec, cgroups_available=self._cgroups.available)

    async def run(self, spec: JobSpec, *, on_output: OutputCallback | None = None) -> JobOutcome:
        """Run the job to completion (or its limits) and report what happened."""
        spec = self._with_netns(spec)
        self._counter += 1
        if not self._cgroups.available:
            return await self._run_in(spec, None, on_output)
        slot = heapq.heappop(self._idle_slots) if self._idle_slots else self._new_slot()
        key, memory, pids = f"s{slot}", spec.limits.memory_bytes, spec.limits.pids
        settled = False
        try:
            cgroup = self._cgroups.pooled(key, memory_bytes=memory, pids=pids)
            if cgroup is not None:
                # Unchanged limits: a counter reset, cheaper inline than a thread hop.
                cgroup.begin(memory_bytes=memory, pids=pids)
            else:
                # To its end: a cancelled job's thread would go on making the cgroup
                # (and opening its descriptors) after the slot was retired below.
                cgroup = await to_thread_to_the_end(
                    functools.partial(self._cgroups.acquire, key, memory_bytes=memory, pids=pids)
                )
            try:
                return await self._run_in(spec, cgroup, on_output)
            finally:
                # Nothing may outlive the job into the slot's next job. Usually nothing
                # is left (the pid namespace died with nsjail): one read says so.
                if cgroup.signal_leftovers():
                    await to_thread_to_the_end(cgroup.kill_all)
                settled = True
        finally:
            if settled:
                heapq.heappush(self._idle_slots, slot)
            else:
                # Cancelled (or failed) in the acquire or the kill: what is left in the
                # slot's cgroup is unknown, so the slot is retired, never handed to the
                # next job; its cgroup and held descriptors go now (no thread of this
                # job runs on it any more: both hops above wait for theirs).
                await to_thread_to_the_end(functools.partial(self._cgroups.retire, key))

    def _new_slot(self) -> int:
        self._slots_made += 1
        return self._slots_made - 1

    def _spawn_request(
        self,
        spec: JobSpec,
        *,
        stdin: int,
        stdout: int,
        stderr: int,
        log_fd: int,
        cgroup: JobCgroup | None,
        close_after: list[int],
    ) -> SpawnRequest:
        """How to start ``spec``: nsjail with its configuration on a pipe (or, unjailed,
        the job itself). Descriptors the caller must close once it has spawned are
        appended to ``close_after``."""
        argv = list(spec.argv)
        pass_fds = list(spec.pass_fds)
        if self._nsjail is not None:
            config = self.config_text(spec).encode()
            if len(config) > MAX_CONFIG_BYTES:
                # No request within the protocol's caps gets here (nsjail_config.py says
                # why): a runner bug, told with what made the configuration large.
                raise JailError(
                    f"job configuration too large: {len(config)} bytes, more than"
                    f" {MAX_CONFIG_BYTES} ({len(spec.env)} variables of"
                    f" {env_bytes(spec.env)} bytes, {len(spec.readonly_binds)} read-only"
                    " binds)"
                )
            # A memfd, not a pipe: nsjail runs as the job's UID and reopens the
            # descriptor by path, and a pipe's inode is its creator's (root), 0600.
            config_fd = os.memfd_create("sandcell-nsjail-config", os.MFD_CLOEXEC)
            close_after.append(config_fd)
            os.write(config_fd, config)
            argv = [str(self._nsjail), "--log_fd", str(log_fd), "--config", f"/dev/fd/{config_fd}"]
            argv += ["--", *spec.argv]
            pass_fds += [config_fd, log_fd]
        # nsjail itself runs as the job's UID, so the user namespace it makes is
        # owned by that UID and the kernel charges the job's per-user budgets
        # (inotify instances and watches, namespaces, fanotify groups) to it in
        # the initial namespace instead of to root, whom every job would share.
        as_job_user = self._as_job_user or (self._nsjail is None and os.geteuid() == 0)
        cgroup_fds = cgroup.join_fds() if cgroup is not None else None
        if cgroup is not None and cgroup_fds is None:
            # v2 has no tasks files: the child writes 0 to cgroup.procs descriptors,
            # opened per job (untested here for holding; its join's threadgroup lock
            # costs more than the open).
            cgroup_fds = cgroup.open_procs_fds()
            close_after += cgroup_fds
        return SpawnRequest(
            argv=argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=self._spawn_env(spec),
            cwd=str(spec.workspace) if self._nsjail is None else None,
            pass_fds=pass_fds,
            cgroup_fds=cgroup_fds or (),
            user=spec.uid if as_job_user else None,
            group=spec.gid if as_job_user else None,
            netns_fd=spec.netns_fd,
        )

    async def _run_in(
        self,
        spec: JobSpec,
        cgroup: JobCgroup | None,
        on_output: OutputCallback | None,
    ) -> JobOutcome:
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        log_r, log_w = os.pipe()
        log_later = widen(log_r)  # before nsjail can write: see where the reader is added
        stdout = Capture("stdout", spec.limits.stdout_bytes, on_output)
        stderr = Capture("stderr", spec.limits.stderr_bytes, on_output)
        jail_log = Capture("log", 256 * 1024, None)
        state = {"timed_out": False, "stdout_limited": False}
        close_after = [out_w, err_w, log_w]
        started = time.monotonic()
        try:
            stdin_fd = self._stdin_fd(spec)
            close_after.append(stdin_fd)
            request = self._spawn_request(
                spec,
                stdin=stdin_fd,
                stdout=out_w,
                stderr=err_w,
                log_fd=log_w,
                cgroup=cgroup,
                close_after=close_after,
            )
            # Not awaited: a failure to start comes from ``process.wait()`` below.
            process = self._spawner.start(request)
        except BaseException:
            # Nothing started (a refused configuration, a lost helper): no reader will.
            for fd in (out_r, err_r, log_r):
                os.close(fd)
            raise
        finally:
            for fd in close_after:
                os.close(fd)

        def kill() -> None:
            process.send_signal(signal.SIGKILL, group=True)
            if cgroup is not None:
                cgroup.kill_all()

        def on_timeout() -> None:
            state["timed_out"] = True
            kill()

        drain_cpu_s = [0.0]  # the runner's own CPU spent on this job's streams
        paused: dict[int, asyncio.TimerHandle] = {}

        def resume(fd: int, capture: Capture, kill_on_cap: bool) -> None:
            paused.pop(fd, None)
            loop.add_reader(fd, reader, fd, capture, kill_on_cap)

        def reader(fd: int, capture: Capture, kill_on_cap: bool) -> None:
            started = time.thread_time()
            try:
                read(fd, capture, kill_on_cap)
            finally:
                drain_cpu_s[0] += time.thread_time() - started

        def read(fd: int, capture: Capture, kill_on_cap: bool) -> None:
            try:
                if capture.truncated and not kill_on_cap:
                    # Past its cap a stream is only drained: the kernel moves the
                    # bytes to /dev/null, a megabyte a call, never through Python.
                    if not capture.draining:
                        capture.draining = True
                        widen(fd)
                    data_len = discard(fd)
                    if data_len is not None:
                        loop.remove_reader(fd)
                        if data_len == 0:
                            capture.eof.set()
                        elif capture.name == "stderr":
                            # Paced: at most a pipeful per interval. A faster flood
                            # waits on its full pipe, in its own time, not the runner's.
                            paused[fd] = loop.call_later(
                                DRAIN_INTERVAL_S, resume, fd, capture, kill_on_cap
                            )
                        else:
                            loop.add_reader(fd, reader, fd, capture, kill_on_cap)
                        return
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not data:
                loop.remove_reader(fd)
                capture.eof.set()
                return
            if capture.feed(data) and kill_on_cap:
                state["stdout_limited"] = True
                kill()

        for fd in (out_r, err_r, log_r):
            os.set_blocking(fd, False)
        loop.add_reader(out_r, reader, out_r, stdout, True)
        loop.add_reader(err_r, reader, err_r, stderr, False)
        # nsjail's log (~3 KiB a job, written a line at a time while it sets the jail
        # up) is read once nsjail has exited: a megabyte of pipe holds far more than
        # a configuration (at most 60 KB) makes it say, and reading it as it came woke
        # the event loop about ten times a job. Where the pipe cannot grow, it is
        # drained as it comes, so a chatty nsjail can never fill the pipe and stall.
        if not log_later:
            loop.add_reader(log_r, reader, log_r, jail_log, False)
        timer = loop.call_later(spec.limits.timeout_ms / 1000, on_timeout)
        try:
            status, rusage = await process.wait()
            if log_later:
                size = -1
                while not jail_log.eof.is_set() and size < jail_log.size:
                    size = jail_log.size  # read to EOF, or to what is there so far
                    reader(log_r, jail_log, False)
                if not jail_log.eof.is_set():
                    # A writer is still open somewhere (nsjail's last child, exiting).
                    loop.add_reader(log_r, reader, log_r, jail_log, False)
            # Output written just before exit is still in the pipes; descendants are
            # dead with the pid namespace, so EOF follows promptly. Usually it already
            # has (the pipes' readers ran before the exit report): then no timer and no
            # tasks, where a gather made three tasks and a future per job.
            pending = [c.eof for c in (stdout, stderr, jail_log) if not c.eof.is_set()]
            if pending:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2):
                        for eof in pending:
                            await eof.wait()
        except BaseException:
            kill()
            # A start that failed raises its error here again: the first is raised.
            with contextlib.suppress(Exception):
                await asyncio.shield(process.wait())
            raise
        finally:
            timer.cancel()
            for handle in paused.values():
                handle.cancel()  # never re-add a reader to a descriptor about to close
            for fd in (out_r, err_r, log_r):
                loop.remove_reader(fd)
                os.close(fd)
        wall_ms = int((time.monotonic() - started) * 1000)
        # Three reads of a few bytes of sysfs (~70 us): inline, not a thread hop.
        stats = cgroup.stats() if cgroup is not None else None
        log_text = jail_log.value().decode("utf-8", "replace")
        exit_code, signame = decode_status(status)
        if self._nsjail is not None:
            reported = job_status_from_log(log_text)
            if reported is not None:
                exit_code, signame = reported
            elif state["timed_out"] or state["stdout_limited"]:
                exit_code, signame = None, "SIGKILL"  # the runner killed nsjail first
            else:
                raise JailError("nsjail could not run the job: " + warnings_only(log_text)[-2000:])
        cpu_ms = int((rusage.ru_utime + rusage.ru_stime) * 1000) if rusage else 0
        return JobOutcome(
            exit_code=exit_code,
            signal=signame,
            timed_out=state["timed_out"],
            stdout_limited=state["stdout_limited"],
            stdout=stdout.value(),
            stderr=stderr.value(),
            stdout_truncated=stdout.truncated,
            stderr_truncated=stderr.truncated,
            wall_ms=wall_ms,
            cpu_ms=cpu_ms,
            max_rss_kib=job_peak_kib(stats, rusage, process.floor_kib),
            cgroup=stats,
            jail_log=warnings_only(log_text),
            drain_cpu_ms=int(drain_cpu_s[0] * 1000),
        )

    def _with_netns(self, spec: JobSpec) -> JobSpec:
        if spec.network:
            return spec
        if spec.netns_fd is None and self.netns_for is not None:
            fd = self.netns_for(spec.workspace)
            spec = spec if fd is None else dataclasses.replace(spec, netns_fd=fd)
        return spec if self.egress_for is None else self.egress_for(spec)

    async def launch(self, spec: JobSpec, *, stdin_fd: int, output_fd: int) -> LaunchedJob:
        """Start a job that outlives the call: stdin from ``stdin_fd``, stdout and stderr
        both to ``output_fd`` (the caller keeps and closes both)."""
        spec = self._with_netns(spec)
        self._counter += 1
        cgroup: JobCgroup | None = None
        if self._cgroups.available:
            # To its end, and removed when cancelled: the cgroup the thread still made
            # was left behind, since only this call would ever have destroyed it.
            cgroup = await to_thread_to_the_end(
                functools.partial(
                    self._cgroups.create,
                    f"{os.getpid()}-{self._counter}",
                    memory_bytes=spec.limits.memory_bytes,
                    pids=spec.limits.pids,
                ),
                undo=JobCgroup.destroy,
            )
        log_r, log_w = os.pipe()
        close_after: list[int] = [log_w]
        try:
            request = self._spawn_request(
                spec,
                stdin=stdin_fd,
                stdout=output_fd,
                stderr=output_fd,
                log_fd=log_w,
                cgroup=cgroup,
                close_after=close_after,
            )
            process = await self._spawner.spawn(request)
        except BaseException:
            os.close(log_r)
            if cgroup is not None:
                await to_thread_to_the_end(cgroup.destroy)
            raise
        finally:
            for fd in close_after:
                os.close(fd)
        return LaunchedJob(
            process, cgroup, log_r, status_of=launch_status if self._nsjail is not None else None
        )

    def _stdin_fd(self, spec: JobSpec) -> int:
        if spec.stdin is None:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        # A file, not a pipe: no writer task to manage, and a job that never reads
        # its stdin cannot block the runner. A memfd where the kernel has them
        # (``stdin.py``: no inode on the workspace root's filesystem, sealed).
        with contextlib.suppress(OSError):
            return sealed_memfd(spec.stdin)
        path = spec.job_dir.parent / f"{spec.job_dir.name}.stdin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.unlink(path)
        os.write(fd, spec.stdin)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _spawn_env(self, spec: JobSpec) -> dict[str, str]:
        if self._nsjail is None:
            return dict(spec.env)
        # nsjail itself gets no environment of the runner (the token stays out).
        return {"PATH": "/usr/bin:/bin"}


__all__ = ["Jail", "JobLimits", "JobSpec", "OutputCallback"]
