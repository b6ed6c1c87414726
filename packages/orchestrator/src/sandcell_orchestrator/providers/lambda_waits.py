"""``MicrovmWaits``: waiting on a MicroVM's state through the control plane.

A launched or resumed VM is RUNNING before its runner listens (the proxy answers
502 until it does), and a suspend is done only once the VM reports SUSPENDED; each
wait polls ``MicrovmApi.status`` and gives up at its deadline or when the VM dies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..errors import SandboxNotFoundError, SandboxUnavailableError
from ..handle import SandboxHandle
from .lambda_client import MicrovmApi, VmStatus

__all__ = ["TERMINAL", "BootDiedError", "MicrovmWaits", "gone"]

TERMINAL = frozenset({"TERMINATING", "TERMINATED"})
_READY_CHECK_S = 1.0
"""How often a readiness wait asks the control plane whether the VM still lives."""


class BootDiedError(Exception):
    """The VM reached TERMINATING/TERMINATED before its runner was ready (internal)."""

    def __init__(self, vm_id: str, reason: str) -> None:
        super().__init__(f"MicroVM {vm_id} died during boot: {reason}")
        self.vm_id = vm_id
        self.reason = reason


def gone(vm_id: str, status: VmStatus) -> SandboxNotFoundError:
    return SandboxNotFoundError(f"MicroVM {vm_id} is {status.state.lower()} ({status.reason})")


class MicrovmWaits:
    """The provider's polls of one control plane, at ``poll_interval_s``."""

    def __init__(
        self,
        api: MicrovmApi,
        *,
        poll_interval_s: float,
        boot_timeout_s: float,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self._api = api
        self._poll_interval_s = poll_interval_s
        self._boot_timeout_s = boot_timeout_s
        self._clock = clock
        self._sleep = sleep

    async def running(self, vm_id: str, status: VmStatus, *, deadline: float) -> VmStatus:
        """Poll from ``status`` until the VM is RUNNING; its status then."""
        while status.state != "RUNNING":
            if status.state in TERMINAL:
                raise BootDiedError(vm_id, status.reason or status.state)
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise SandboxUnavailableError(
                    f"MicroVM {vm_id} not RUNNING in time (state {status.state})"
                )
            await self._sleep(min(self._poll_interval_s, remaining))
            status = await self._api.status(vm_id)
        return status

    async def runner_ready(self, vm_id: str, handle: SandboxHandle, *, deadline: float) -> None:
        """Poll the runner's /health through the proxy, checking now and then that the VM lives.

        RUNNING comes before the runner listens: the proxy answers 502 until it does.
        """
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise SandboxUnavailableError(f"MicroVM {vm_id}: runner not ready in time")
            try:
                await handle.runner.wait_ready(timeout_s=min(remaining, _READY_CHECK_S))
            except SandboxUnavailableError:
                pass
            else:
                return
            status = await self._api.status(vm_id)
            if status.state in TERMINAL:
                raise BootDiedError(vm_id, status.reason or status.state)

    async def state(self, vm_id: str, wanted: str) -> None:
        """Poll until the VM is in state ``wanted``, for at most the boot timeout."""
        deadline = self._clock() + self._boot_timeout_s
        while True:
            status = await self._api.status(vm_id)
            if status.state == wanted:
                return
            if status.state in TERMINAL:
                raise gone(vm_id, status)
            if self._clock() >= deadline:
                raise SandboxUnavailableError(
                    f"MicroVM {vm_id} not {wanted} (it is {status.state})"
                )
            await self._sleep(self._poll_interval_s)
