"""The emulator's admin routes under ``/_emulator``: what a test does to the fake cloud.

``POST /_emulator/faults`` merges fields into the faults, ``GET /_emulator/vms``
lists the VMs with their runners' pids, ``POST /_emulator/vms/<id>/kill`` crashes
one, ``POST /_emulator/clock/advance`` moves idle timers and token expiry forward,
and ``GET /_emulator/calls`` lists the recorded control-plane calls (``RecordedCall``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .vm import EmulatorClock, Faults, MicrovmFleet

__all__ = ["EmulatorAdmin", "RecordedCall"]


@dataclass(frozen=True, slots=True)
class RecordedCall:
    """One control-plane call as the emulator saw it."""

    operation: str
    microvm_id: str | None = None
    client_token: str | None = None
    throttled: bool = False


class EmulatorAdmin:
    """The admin routes over the emulator's faults, fleet, clock and ``calls``."""

    def __init__(
        self,
        *,
        faults: Faults,
        fleet: MicrovmFleet,
        clock: EmulatorClock,
        calls: list[RecordedCall],
    ) -> None:
        self._faults = faults
        self._fleet = fleet
        self._clock = clock
        self._calls = calls

    def routes(self) -> list[Route]:
        return [
            Route("/_emulator/faults", self.set_faults, methods=["POST"]),
            Route("/_emulator/vms", self.list_vms, methods=["GET"]),
            Route("/_emulator/vms/{vm_id}/kill", self.kill_vm, methods=["POST"]),
            Route("/_emulator/clock/advance", self.advance_clock, methods=["POST"]),
            Route("/_emulator/calls", self.list_calls, methods=["GET"]),
        ]

    async def set_faults(self, request: Request) -> Response:
        """Merge the posted fields into the faults (sets of launch numbers as lists)."""
        body = await request.json()
        for name, value in body.items():
            current = getattr(self._faults, name, None)
            if current is None and name != "token_lifetime_s":
                return JSONResponse({"message": f"unknown fault {name!r}"}, status_code=400)
            setattr(self._faults, name, set(value) if isinstance(current, set) else value)
        return JSONResponse(
            {k: sorted(v) if isinstance(v, set) else v for k, v in asdict(self._faults).items()}
        )

    async def list_vms(self, request: Request) -> Response:
        return JSONResponse(
            [
                {"microvmId": vm.microvm_id, "state": vm.state.value, "pid": vm.pid}
                for vm in self._fleet.vms.values()
            ]
        )

    async def kill_vm(self, request: Request) -> Response:
        """A VM crashes: its runner is killed and the VM is TERMINATED."""
        vm = self._fleet.vms.get(request.path_params["vm_id"])
        if vm is None:
            return JSONResponse({"message": "no such MicroVM"}, status_code=404)
        await self._fleet.terminate(vm, reason="Runtime.ExitError: killed (injected fault)")
        return JSONResponse({"microvmId": vm.microvm_id, "state": vm.state.value})

    async def advance_clock(self, request: Request) -> Response:
        self._clock.advance(float((await request.json())["seconds"]))
        return JSONResponse({"offset_s": self._clock.offset_s})

    async def list_calls(self, request: Request) -> Response:
        return JSONResponse([asdict(call) for call in self._calls])
