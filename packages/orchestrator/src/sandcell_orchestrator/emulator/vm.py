"""Emulated MicroVMs: each one a real ``sandcell-runner`` process on loopback.

A VM's runner gets its own workspace root under the emulator's base directory
(which must be 0711: job UIDs traverse it), ``SANDCELL_RUNNER_SESSIONS=1``, and
its token from the ``runHookPayload`` (what the image's run hook does on AWS).
Suspend freezes the runner's whole process tree with SIGSTOP, resume thaws it
with SIGCONT, so memory, processes and files survive exactly as on a MicroVM.

``MicrovmFleet`` owns the VMs and their state machine (PENDING → RUNNING ⇄
SUSPENDED → TERMINATED), the idle policy and the faults.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
import psutil

from ..providers.lambda_auth import decode_run_hook_payload
from ..providers.runner_roots import free_loopback_port, reap_runner_cgroups, remove_runner_root

__all__ = [
    "EmulatedVm",
    "EmulatorClock",
    "Faults",
    "IdlePolicy",
    "MicrovmFleet",
    "ServiceError",
    "VmState",
    "not_found",
]

log = logging.getLogger(__name__)


class VmState(enum.StrEnum):
    """The service model's ``MicrovmState``."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDING = "SUSPENDING"
    SUSPENDED = "SUSPENDED"
    TERMINATING = "TERMINATING"
    TERMINATED = "TERMINATED"


TERMINAL = frozenset({VmState.TERMINATING, VmState.TERMINATED})


class ServiceError(Exception):
    """A rest-json error answer: HTTP status, ``x-amzn-ErrorType`` code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def not_found(what: str) -> ServiceError:
    return ServiceError(404, "ResourceNotFoundException", f"{what} not found")


class EmulatorClock:
    """Monotonic time that tests can move forward (idle policy, token expiry)."""

    def __init__(self, base: Callable[[], float] = time.monotonic) -> None:
        self._base = base
        self.offset_s = 0.0

    def __call__(self) -> float:
        return self._base() + self.offset_s

    def advance(self, seconds: float) -> None:
        """Jump ahead: every deadline measured by this clock comes ``seconds`` closer."""
        self.offset_s += seconds


@dataclass
class Faults:
    """What goes wrong, set by constructor or ``POST /_emulator/faults``."""

    boot_death_on_launch: set[int] = field(default_factory=set)
    """1-based launch numbers whose VM terminates before it runs."""
    runner_exits_on_launch: set[int] = field(default_factory=set)
    """1-based launch numbers whose VM terminates after RUNNING, before its runner listens."""
    throttle: dict[str, int] = field(default_factory=dict)
    """Operation name (or ``"*"``) → how many upcoming calls answer ThrottlingException."""
    boot_delay_s: float = 0.0
    """How long a launch stays PENDING."""
    listener_delay_s: float = 0.0
    """How long a VM is RUNNING before its runner even starts (the proxy answers 502)."""
    token_lifetime_s: float | None = None
    """Overrides ``expirationInMinutes`` of minted proxy tokens."""
    image_build_fails: bool = False

    def take_throttle(self, operation: str) -> bool:
        """Consume one injected throttle for ``operation``, if any is left."""
        for key in (operation, "*"):
            left = self.throttle.get(key, 0)
            if left > 0:
                self.throttle[key] = left - 1
                return True
        return False


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    max_idle_s: int
    suspended_s: int
    auto_resume: bool


@dataclass(eq=False)
class EmulatedVm:
    """One emulated MicroVM and its runner process."""

    microvm_id: str
    image_arn: str
    image_version: str
    idle: IdlePolicy | None
    max_duration_s: int
    root: Path
    started_at: float
    started_mono: float
    execution_role_arn: str | None = None
    egress: tuple[str, ...] = ()
    ingress: tuple[str, ...] = ()
    state: VmState = VmState.PENDING
    state_reason: str | None = None
    terminated_at: float | None = None
    process: subprocess.Popen[bytes] | None = None
    runner_port: int = 0
    last_activity: float = 0.0
    suspended_since: float | None = None
    in_flight: int = 0
    runner_env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


# -- processes -------------------------------------------------------------------------


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal_tree(process: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the runner's process group, then every descendant (jobs may have their own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
    for child in _tree(process.pid):
        with contextlib.suppress(psutil.Error):
            child.send_signal(signum)


def _kill(process: subprocess.Popen[bytes]) -> None:
    descendants = _tree(process.pid)
    _signal_tree(process, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


class MicrovmFleet:
    """Every emulated VM, its proxy tokens, and the rules time applies to them."""

    def __init__(
        self,
        *,
        base_dir: Path,
        faults: Faults,
        clock: EmulatorClock,
        runner_command: Sequence[str] = (sys.executable, "-m", "sandcell_runner"),
        runner_env: Mapping[str, str] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.base_dir = base_dir
        self.faults = faults
        self.clock = clock
        self.runner_command = tuple(runner_command)
        self.runner_env = dict(runner_env or {})
        self.wall_clock = wall_clock
        self.vms: dict[str, EmulatedVm] = {}
        self.launches = 0
        self._tasks: anyio.abc.TaskGroup | None = None

    def attach(self, tasks: anyio.abc.TaskGroup) -> None:
        """The task group boots run in (the app's lifespan)."""
        self._tasks = tasks

    # -- launch -------------------------------------------------------------------------

    def launch(
        self,
        *,
        image_arn: str,
        image_version: str,
        image_env: Mapping[str, str],
        idle: IdlePolicy | None,
        max_duration_s: int,
        run_hook_payload: str | None,
        execution_role_arn: str | None = None,
        egress: Sequence[str] = (),
        ingress: Sequence[str] = (),
    ) -> EmulatedVm:
        """Create a PENDING VM and start booting it in the background."""
        if self._tasks is None:
            raise RuntimeError("the fleet is not running")
        self.launches += 1
        vm_id = f"mvm-{secrets.token_hex(8)}"
        root = self.base_dir / vm_id
        now = self.clock()
        vm = EmulatedVm(
            microvm_id=vm_id,
            image_arn=image_arn,
            image_version=image_version,
            idle=idle,
            max_duration_s=max_duration_s,
            root=root,
            started_at=self.wall_clock(),
            started_mono=now,
            execution_role_arn=execution_role_arn,
            egress=tuple(egress),
            ingress=tuple(ingress),
            last_activity=now,
        )
        vm.runner_env = self._runner_env(vm, image_env, run_hook_payload)
        self.vms[vm_id] = vm
        self._tasks.start_soon(self._boot, vm, self.launches)
        return vm

    def _runner_env(
        self, vm: EmulatedVm, image_env: Mapping[str, str], payload: str | None
    ) -> dict[str, str]:
        vm.runner_port = free_loopback_port()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "SANDCELL_RUNNER_SESSIONS": "1",
            **{k: v for k, v in os.environ.items() if k in ("LANG", "SANDCELL_NSJAIL")},
            **image_env,
            **self.runner_env,
            "SANDCELL_RUNNER_HOST": "127.0.0.1",
            "SANDCELL_RUNNER_PORT": str(vm.runner_port),
            "SANDCELL_WORKSPACE_ROOT": str(vm.root / "workspaces"),
            "SANDCELL_INPUT_CACHE_DIR": str(vm.root / "input-cache"),
        }
        # What the image's /run hook does on AWS: hand the payload's token to the runner.
        token = decode_run_hook_payload(payload) if payload else None
        if token is not None:
            env["SANDCELL_RUNNER_TOKEN"] = token
        return env

    async def _boot(self, vm: EmulatedVm, launch_number: int) -> None:
        try:
            if self.faults.boot_delay_s > 0:
                await anyio.sleep(self.faults.boot_delay_s)
            if vm.state is not VmState.PENDING:
                return
            if launch_number in self.faults.boot_death_on_launch:
                vm.state = VmState.TERMINATING
                await anyio.sleep(0.05)
                self._mark_terminated(vm, "Runtime.ExitError: the application exited during boot")
                return
            vm.state = VmState.RUNNING
            vm.last_activity = self.clock()
            if self.faults.listener_delay_s > 0:
                await anyio.sleep(self.faults.listener_delay_s)
            if vm.state in TERMINAL:
                return
            if launch_number in self.faults.runner_exits_on_launch:
                await self.terminate(vm, reason="Runtime.ExitError: the application exited")
                return
            process = await anyio.to_thread.run_sync(self._spawn, vm)
            if vm.state in TERMINAL:
                # Terminated while the spawn ran in its thread: ``terminate`` found no
                # process to kill, and the runner went on as an orphan (a ResourceWarning
                # in whichever test then collected its Popen).
                await anyio.to_thread.run_sync(_kill, process)
                await anyio.to_thread.run_sync(reap_runner_cgroups, self.runner_command[0], vm.root)
                await anyio.to_thread.run_sync(remove_runner_root, vm.root)
                return
            vm.process = process
            if vm.state is VmState.SUSPENDED:
                _signal_tree(vm.process, signal.SIGSTOP)
        except Exception:
            log.exception("emulator: booting %s failed", vm.microvm_id)
            await self.terminate(vm, reason="InternalError: the emulator could not boot the VM")

    def _spawn(self, vm: EmulatedVm) -> subprocess.Popen[bytes]:
        vm.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(vm.root, 0o711)  # noqa: S103 - job UIDs traverse it, as the base dir
        with (vm.root / "runner.log").open("ab") as log_file:
            return subprocess.Popen(
                self.runner_command,
                env=vm.runner_env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    # -- state changes --------------------------------------------------------------------

    def _mark_terminated(self, vm: EmulatedVm, reason: str) -> None:
        vm.state = VmState.TERMINATED
        vm.state_reason = reason
        vm.terminated_at = self.wall_clock()

    async def terminate(self, vm: EmulatedVm, *, reason: str) -> None:
        """Kill the runner, remove its files; TERMINATED. Idempotent."""
        if vm.state is VmState.TERMINATED:
            return
        vm.state = VmState.TERMINATING
        process, vm.process = vm.process, None
        if process is not None:
            await anyio.to_thread.run_sync(_kill, process)
            # SIGKILLed: the runner could not remove its cgroups itself.
            await anyio.to_thread.run_sync(reap_runner_cgroups, self.runner_command[0], vm.root)
        await anyio.to_thread.run_sync(remove_runner_root, vm.root)
        self._mark_terminated(vm, reason)
        log.info("emulator: %s terminated (%s)", vm.microvm_id, reason)

    def suspend(self, vm: EmulatedVm) -> None:
        """Freeze the runner's process tree (SIGSTOP); SUSPENDED."""
        vm.state = VmState.SUSPENDING
        if vm.process is not None:
            _signal_tree(vm.process, signal.SIGSTOP)
        vm.state = VmState.SUSPENDED
        vm.suspended_since = self.clock()
        log.info("emulator: %s suspended", vm.microvm_id)

    def resume(self, vm: EmulatedVm) -> None:
        """Thaw the runner's process tree (SIGCONT); RUNNING."""
        if vm.process is not None:
            _signal_tree(vm.process, signal.SIGCONT)
        vm.state = VmState.RUNNING
        vm.suspended_since = None
        vm.last_activity = self.clock()
        log.info("emulator: %s resumed", vm.microvm_id)

    async def shutdown(self) -> None:
        """Terminate every VM (the emulator is going away)."""
        for vm in list(self.vms.values()):
            await self.terminate(vm, reason="the emulator shut down")

    # -- time ---------------------------------------------------------------------------

    def touch(self, vm: EmulatedVm) -> None:
        vm.last_activity = self.clock()

    async def sweep(self) -> None:
        """Apply the idle policy and maximum duration; notice runners that died."""
        now = self.clock()
        for vm in list(self.vms.values()):
            if vm.state in TERMINAL:
                continue
            if now - vm.started_mono >= vm.max_duration_s:
                await self.terminate(vm, reason="MaximumDurationExceeded")
            elif vm.process is not None and vm.process.poll() is not None:
                code = vm.process.returncode
                await self.terminate(vm, reason=f"Runtime.ExitError: the runner exited ({code})")
            elif vm.idle is None:
                continue
            elif vm.state is VmState.RUNNING and vm.in_flight == 0:
                if now - vm.last_activity >= vm.idle.max_idle_s:
                    self.suspend(vm)
            elif (
                vm.state is VmState.SUSPENDED
                and vm.suspended_since is not None
                and now - vm.suspended_since >= vm.idle.suspended_s
            ):
                await self.terminate(vm, reason="IdleRetentionExceeded")
