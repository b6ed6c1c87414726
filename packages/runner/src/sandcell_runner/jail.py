"""Runs one job under nsjail with hard limits; the only module that knows nsjail's flags.

Each job gets its own nsjail configuration (written into a pipe nsjail reads as
``/dev/fd/N``, so nothing touches disk) with new user, pid, mount, ipc, uts, cgroup
and network namespaces; the job's UID is mapped to the same unprivileged UID outside.
Memory and pids are limited by the job cgroup (``cgroups.py``); wall time by the
runner's own timer (so a timeout is known, not guessed), with nsjail's ``time_limit``
as a backstop.

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
import math
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .cgroups import CgroupManager, JobCgroup, JobCgroupStats
from .errors import JailError
from .languages import JOB_DIR, WORKSPACE_DIR
from .launched import LaunchedJob
from .spawner import Spawner, SpawnRequest, wait_process

MIB = 1024 * 1024

# Syscalls a job never needs and that widen the kernel's attack surface. clone()
# with any CLONE_NEW* flag gets its own rule: blocking unshare() alone does not stop
# a nested user namespace. clone3 answers ENOSYS so libc falls back to clone(),
# whose flags seccomp can inspect, and threads keep working.
SECCOMP_POLICY = (
    "ERRNO(1) { ptrace, process_vm_readv, process_vm_writev, mount, umount, "
    "pivot_root, chroot, unshare, setns, keyctl, add_key, request_key, bpf, userfaultfd, "
    "perf_event_open, kexec_load, kexec_file_load, init_module, finit_module, delete_module, "
    "reboot, swapon, swapoff, syslog, acct, open_by_handle_at, name_to_handle_at, fsopen, "
    "fsmount, fsconfig, fspick, move_mount, open_tree, io_uring_setup, io_uring_enter, "
    "io_uring_register }",
    "ERRNO(1) { clone { (clone_flags & 0x7E020000) != 0 } }",
    "ERRNO(38) { clone3 }",
    "DEFAULT ALLOW",
)

_SYSTEM_MOUNTS = (
    # (source, mandatory)
    ("/usr", True),
    ("/lib", True),
    ("/lib64", False),
    ("/bin", True),
    ("/sbin", False),
    ("/etc/ld.so.cache", False),
    ("/etc/alternatives", False),
    ("/etc/localtime", False),
)
_NETWORK_MOUNTS = ("/etc/resolv.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates")


@dataclass(frozen=True, slots=True)
class JobLimits:
    """Resolved limits of one job (request values already capped by configuration)."""

    timeout_ms: int
    memory_bytes: int
    pids: int
    stdout_bytes: int
    stderr_bytes: int
    file_size_mib: int
    open_files: int
    tmp_mib: int


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything nsjail needs to run one job."""

    argv: Sequence[str]
    workspace: Path
    job_dir: Path
    uid: int
    gid: int
    env: Mapping[str, str]
    limits: JobLimits
    stdin: bytes | None = None
    network: bool = False
    readonly_binds: Sequence[tuple[Path, str]] = ()
    netns_fd: int | None = None
    """Run in this network namespace (None: a fresh one, or the session's; see ``Jail``)."""
    long_running: bool = False
    """No nsjail time or CPU limit; fatal signals to nsjail are forwarded to the job."""
    pass_fds: Sequence[int] = ()
    """Extra descriptors the job inherits under the same numbers."""


OutputCallback = Callable[[str, bytes], None]


@dataclass(slots=True)
class JobOutcome:
    """What happened to a job, as measured by the runner."""

    exit_code: int | None
    signal: str | None
    timed_out: bool
    stdout_limited: bool
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_ms: int
    cpu_ms: int
    max_rss_kib: int | None
    cgroup: JobCgroupStats | None
    jail_log: str = ""


class _Capture:
    """Keeps a stream's bytes up to its cap; past it, notes truncation and drops the rest."""

    def __init__(self, name: str, cap: int, on_output: OutputCallback | None) -> None:
        self.name = name
        self.cap = cap
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False
        self.eof = asyncio.Event()
        self._on_output = on_output

    def feed(self, data: bytes) -> bool:
        """Store ``data``; return True when this chunk pushed the stream past its cap."""
        room = self.cap - self.size
        if room <= 0:
            self.truncated = True
            return False
        kept = data[:room]
        self.chunks.append(kept)
        self.size += len(kept)
        if self._on_output is not None and kept:
            self._on_output(self.name, kept)
        if len(data) > room:
            self.truncated = True
            return True
        return False

    def value(self) -> bytes:
        return b"".join(self.chunks)


class Jail:
    """Runs jobs under nsjail (or, for developer machines, unjailed)."""

    def __init__(
        self,
        *,
        nsjail: Path | None,
        cgroups: CgroupManager,
        spawner: Spawner,
    ) -> None:
        self._nsjail = nsjail
        self._cgroups = cgroups
        self._spawner = spawner
        self._counter = 0
        self.netns_for: Callable[[Path], int | None] | None = None
        """Which network namespace a job in this workspace joins (the session's);
        set by the service. Jobs with ``network`` or an explicit ``netns_fd`` skip it."""

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
        limits = spec.limits
        timeout_s = max(1, math.ceil(limits.timeout_ms / 1000))
        lines = [
            'name: "sandcell-job"',
            "mode: ONCE",
            'hostname: "sandbox"',
            f'cwd: "{WORKSPACE_DIR}"',
            # Backstop only: the runner's own timer kills at the exact deadline.
            f"time_limit: {0 if spec.long_running else timeout_s + 2}",
            # INFO: the last line says "exited with status: N" or "terminated with
            # signal: SIGX (N)", the only way to tell `exit 137` from a SIGKILL.
            "log_level: INFO",
            "keep_env: false",
            "keep_caps: false",
            "disable_no_new_privs: false",
            f"clone_newnet: {'false' if spec.network or spec.netns_fd is not None else 'true'}",
            "clone_newuser: true",
            "clone_newns: true",
            "clone_newpid: true",
            "clone_newipc: true",
            "clone_newuts: true",
            "clone_newcgroup: true",
            f'uidmap {{ inside_id: "{spec.uid}" outside_id: "{spec.uid}" count: 1 }}',
            f'gidmap {{ inside_id: "{spec.gid}" outside_id: "{spec.gid}" count: 1 }}',
            "rlimit_cpu_type: INF" if spec.long_running else f"rlimit_cpu: {timeout_s + 1}",
            f"rlimit_fsize: {limits.file_size_mib}",
            f"rlimit_nofile: {limits.open_files}",
            "rlimit_core: 0",
            "rlimit_stack: 8",
        ]
        if self._cgroups.available:
            lines.append("rlimit_as_type: INF")
        else:
            # Without a memory cgroup, address space is the only memory bound left.
            lines.append(f"rlimit_as: {max(64, limits.memory_bytes // MIB)}")
            lines.append(f"rlimit_nproc: {limits.pids}")
        if spec.long_running:
            lines.append("forward_signals: true")
        lines += [f"pass_fd: {fd}" for fd in spec.pass_fds]
        for key, value in spec.env.items():
            lines.append(f"envar: {_quote(f'{key}={value}')}")
        lines.append("mount_proc: true")
        for source, mandatory in _SYSTEM_MOUNTS:
            lines.append(_bind(source, source, rw=False, mandatory=mandatory))
        if spec.network:
            for source in _NETWORK_MOUNTS:
                lines.append(_bind(source, source, rw=False, mandatory=False))
        elif spec.netns_fd is not None:
            # Without it "localhost" does not resolve, and dev servers bind to it.
            lines.append(_bind("/etc/hosts", "/etc/hosts", rw=False, mandatory=False))
        lines += [
            'mount { dst: "/dev" fstype: "tmpfs" options: "size=1048576,mode=755" rw: true '
            "nosuid: true noexec: true }",
            'mount { src: "/dev/null" dst: "/dev/null" is_bind: true rw: true }',
            'mount { src: "/dev/zero" dst: "/dev/zero" is_bind: true rw: true }',
            'mount { src: "/dev/full" dst: "/dev/full" is_bind: true rw: true mandatory: false }',
            'mount { src: "/dev/urandom" dst: "/dev/urandom" is_bind: true rw: false }',
            'mount { src: "/dev/urandom" dst: "/dev/random" is_bind: true rw: false }',
            f'mount {{ dst: "/dev/shm" fstype: "tmpfs" options: "size={16 * MIB}" rw: true '
            "nosuid: true nodev: true }",
            'mount { src: "/proc/self/fd" dst: "/dev/fd" is_symlink: true }',
            'mount { src: "/proc/self/fd/0" dst: "/dev/stdin" is_symlink: true }',
            'mount { src: "/proc/self/fd/1" dst: "/dev/stdout" is_symlink: true }',
            'mount { src: "/proc/self/fd/2" dst: "/dev/stderr" is_symlink: true }',
            f'mount {{ dst: "/tmp" fstype: "tmpfs" options: "size={limits.tmp_mib * MIB}" '
            "rw: true nosuid: true nodev: true }",
            _bind(str(spec.job_dir), JOB_DIR, rw=False),
            _bind(str(spec.workspace), WORKSPACE_DIR, rw=True),
        ]
        for bind_source, target in spec.readonly_binds:
            lines.append(_bind(str(bind_source), target, rw=False))
        lines += [f"seccomp_string: {_quote(rule)}" for rule in SECCOMP_POLICY]
        return "\n".join(lines) + "\n"

    async def run(self, spec: JobSpec, *, on_output: OutputCallback | None = None) -> JobOutcome:
        """Run the job to completion (or its limits) and report what happened."""
        spec = self._with_netns(spec)
        self._counter += 1
        cgroup: JobCgroup | None = None
        if self._cgroups.available:
            # One reusable cgroup per job UID: a UID never runs two one-shot jobs at once.
            key, memory, pids = f"u{spec.uid}", spec.limits.memory_bytes, spec.limits.pids
            cgroup = self._cgroups.pooled(key, memory_bytes=memory, pids=pids)
            if cgroup is not None:
                # Unchanged limits: a counter reset, cheaper inline than a thread hop.
                cgroup.begin(memory_bytes=memory, pids=pids)
            else:
                cgroup = await asyncio.to_thread(
                    self._cgroups.acquire, key, memory_bytes=memory, pids=pids
                )
        try:
            return await self._run_in(spec, cgroup, on_output)
        finally:
            # Nothing may outlive the job into the next one of this UID. Usually
            # nothing is left (the pid namespace died with nsjail): one read says so.
            if cgroup is not None and cgroup.signal_leftovers():
                await asyncio.to_thread(cgroup.kill_all)

    def _argv_and_fds(self, spec: JobSpec) -> tuple[list[str], list[int], list[int]]:
        """nsjail argv with its config pipe; returns (argv, fds to pass, fds to close)."""
        if self._nsjail is None:
            return list(spec.argv), [], []
        config = self.config_text(spec).encode()
        read_fd, write_fd = os.pipe()
        try:
            # The config fits a pipe buffer (64 KiB) unless env is huge; check, don't hang.
            if len(config) > 60_000:
                raise JailError("job configuration too large (environment too big)")
            os.write(write_fd, config)
        finally:
            os.close(write_fd)
        argv = [str(self._nsjail), "--config", f"/dev/fd/{read_fd}", "--", *spec.argv]
        return argv, [read_fd], [read_fd]

    async def _run_in(
        self, spec: JobSpec, cgroup: JobCgroup | None, on_output: OutputCallback | None
    ) -> JobOutcome:
        loop = asyncio.get_running_loop()
        argv, pass_fds, close_after = self._argv_and_fds(spec)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        log_r, log_w = os.pipe()
        stdin_fd = self._stdin_fd(spec)
        cgroup_fds = cgroup.open_procs_fds() if cgroup is not None else []
        stdout = _Capture("stdout", spec.limits.stdout_bytes, on_output)
        stderr = _Capture("stderr", spec.limits.stderr_bytes, on_output)
        jail_log = _Capture("log", 256 * 1024, None)
        state = {"timed_out": False, "stdout_limited": False}
        if self._nsjail is not None:
            argv = [argv[0], "--log_fd", str(log_w), *argv[1:]]
            pass_fds = [*pass_fds, log_w]
        request = SpawnRequest(
            argv=argv,
            stdin=stdin_fd,
            stdout=out_w,
            stderr=err_w,
            env=self._spawn_env(spec),
            cwd=str(spec.workspace) if self._nsjail is None else None,
            pass_fds=pass_fds,
            cgroup_fds=cgroup_fds,
            cgroup_tasks=cgroup.thread_join_paths() if cgroup is not None else None,
            resident_key=f"u{spec.uid}" if cgroup is not None else None,
            user=spec.uid if self._nsjail is None and os.geteuid() == 0 else None,
            group=spec.gid if self._nsjail is None and os.geteuid() == 0 else None,
            netns_fd=spec.netns_fd,
        )
        started = time.monotonic()
        try:
            process = await self._spawner.spawn(request)
        finally:
            for fd in (out_w, err_w, log_w, stdin_fd, *cgroup_fds, *close_after):
                os.close(fd)

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            if cgroup is not None:
                cgroup.kill_all()

        def on_timeout() -> None:
            state["timed_out"] = True
            kill()

        def reader(fd: int, capture: _Capture, kill_on_cap: bool) -> None:
            try:
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
        # Drained as it comes so a chatty nsjail can never fill the pipe and stall.
        loop.add_reader(log_r, reader, log_r, jail_log, False)
        timer = loop.call_later(spec.limits.timeout_ms / 1000, on_timeout)
        try:
            status, rusage = await wait_process(process)
            # Output written just before exit is still in the pipes; descendants are
            # dead with the pid namespace, so EOF follows promptly.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await asyncio.gather(stdout.eof.wait(), stderr.eof.wait(), jail_log.eof.wait())
        except BaseException:
            kill()
            with contextlib.suppress(ChildProcessError):
                await asyncio.shield(asyncio.to_thread(os.waitpid, process.pid, 0))
            process.returncode = -9
            raise
        finally:
            timer.cancel()
            for fd in (out_r, err_r, log_r):
                loop.remove_reader(fd)
                os.close(fd)
        wall_ms = int((time.monotonic() - started) * 1000)
        # Three reads of a few bytes of sysfs (~70 us): inline, not a thread hop.
        stats = cgroup.stats() if cgroup is not None else None
        log_text = jail_log.value().decode("utf-8", "replace")
        exit_code, signame = _decode_status(status)
        if self._nsjail is not None:
            try:
                exit_code, signame = _job_status_from_log(log_text, exit_code, signame)
            except _JailFailed:
                if not state["timed_out"] and not state["stdout_limited"]:
                    raise JailError(
                        "nsjail could not run the job: " + _warnings_only(log_text)[-2000:]
                    ) from None
                exit_code, signame = None, "SIGKILL"
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
            max_rss_kib=rusage.ru_maxrss if rusage else None,
            cgroup=stats,
            jail_log=_warnings_only(log_text),
        )

    def _with_netns(self, spec: JobSpec) -> JobSpec:
        if spec.network or spec.netns_fd is not None or self.netns_for is None:
            return spec
        fd = self.netns_for(spec.workspace)
        return spec if fd is None else dataclasses.replace(spec, netns_fd=fd)

    async def launch(self, spec: JobSpec, *, stdin_fd: int, output_fd: int) -> LaunchedJob:
        """Start a job that outlives the call: stdin from ``stdin_fd``, stdout and stderr
        both to ``output_fd`` (the caller keeps and closes both)."""
        spec = self._with_netns(spec)
        self._counter += 1
        cgroup: JobCgroup | None = None
        if self._cgroups.available:
            cgroup = await asyncio.to_thread(
                self._cgroups.create,
                f"{os.getpid()}-{self._counter}",
                memory_bytes=spec.limits.memory_bytes,
                pids=spec.limits.pids,
            )
        log_r, log_w = os.pipe()
        close_after: list[int] = [log_w]
        try:
            argv, pass_fds, config_fds = self._argv_and_fds(spec)
            close_after += config_fds
            cgroup_fds = cgroup.open_procs_fds() if cgroup is not None else []
            close_after += cgroup_fds
            if self._nsjail is not None:
                argv = [argv[0], "--log_fd", str(log_w), *argv[1:]]
                pass_fds = [*pass_fds, log_w]
            unjailed_root = self._nsjail is None and os.geteuid() == 0
            request = SpawnRequest(
                argv=argv,
                stdin=stdin_fd,
                stdout=output_fd,
                stderr=output_fd,
                env=self._spawn_env(spec),
                cwd=str(spec.workspace) if self._nsjail is None else None,
                pass_fds=[*pass_fds, *spec.pass_fds],
                cgroup_fds=cgroup_fds,
                cgroup_tasks=cgroup.thread_join_paths() if cgroup is not None else None,
                user=spec.uid if unjailed_root else None,
                group=spec.gid if unjailed_root else None,
                netns_fd=spec.netns_fd,
            )
            process = await self._spawner.spawn(request)
        except BaseException:
            os.close(log_r)
            if cgroup is not None:
                await asyncio.shield(asyncio.to_thread(cgroup.destroy))
            raise
        finally:
            for fd in close_after:
                os.close(fd)
        return LaunchedJob(
            process, cgroup, log_r, status_of=_launch_status if self._nsjail is not None else None
        )

    def _stdin_fd(self, spec: JobSpec) -> int:
        if spec.stdin is None:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        # A file, not a pipe: no writer task to manage, and a job that never reads
        # its stdin cannot block the runner.
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


def _bind(source: str, target: str, *, rw: bool, mandatory: bool = True) -> str:
    flags = f"rw: {'true' if rw else 'false'} nosuid: true nodev: true"
    optional = "" if mandatory else " mandatory: false"
    return (
        f"mount {{ src: {_quote(source)} dst: {_quote(target)} is_bind: true {flags}{optional} }}"
    )


def _quote(value: str) -> str:
    """A protobuf text-format string literal (escapes everything but printable ASCII)."""
    # Fast path: most values (paths, seccomp rules) need no escaping; the per-byte
    # loop below cost ~0.7 ms of CPU per job when run on every line.
    if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
        return f'"{value}"'
    out = ['"']
    for byte in value.encode("utf-8"):
        char = chr(byte)
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    out.append('"')
    return "".join(out)


_EXITED_RE = re.compile(r"\) exited with status: (\d+)")
_SIGNALED_RE = re.compile(r"\) terminated with signal: \w+ \((\d+)\)")


def _job_status_from_log(
    log_text: str, exit_code: int | None, signame: str | None
) -> tuple[int | None, str | None]:
    """The job's own status from nsjail's log; nsjail's exit code is 128+N for both."""
    for line in reversed(log_text.splitlines()):
        if match := _EXITED_RE.search(line):
            return int(match.group(1)), None
        if match := _SIGNALED_RE.search(line):
            return None, _signal_name(int(match.group(1)))
    raise _JailFailed(log_text)


def _launch_status(log_text: str, status: int) -> tuple[int | None, str | None, bool]:
    """(exit code, signal, whether nsjail never reported the job's end) of a launched job."""
    exit_code, signame = _decode_status(status)
    try:
        return (*_job_status_from_log(log_text, exit_code, signame), False)
    except _JailFailed:
        return exit_code, signame, True


class _JailFailed(Exception):
    """nsjail exited without running the job to an end (configuration, namespaces)."""


def _warnings_only(log_text: str) -> str:
    kept = [line for line in log_text.splitlines() if not line.startswith("[I]")]
    return "\n".join(kept)[-8192:]


def _decode_status(status: int) -> tuple[int | None, str | None]:
    if os.WIFSIGNALED(status):
        return None, _signal_name(os.WTERMSIG(status))
    return os.WEXITSTATUS(status), None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


__all__ = ["Jail", "JobLimits", "JobOutcome", "JobSpec"]
