"""A local emulator of the ``lambda-microvms`` REST-JSON API, and of each VM's proxy.

The provider runs against it unchanged through
``boto3.client("lambda-microvms", endpoint_url=...)`` (any dummy credentials).
Routes follow botocore's service model (``2025-09-09``) for the operations the
provider and ``scripts/create-microvm-image`` use; errors are rest-json errors
(``x-amzn-ErrorType``). Each VM's endpoint is ``<emulator>/vm/<id>`` (``proxy.py``).

Test and demo infrastructure, never shipped in an image. Admin routes under
``/_emulator`` (``admin.py``) inject faults, kill VMs, move the clock and list
recorded calls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .admin import EmulatorAdmin, RecordedCall
from .images import ImageRegistry
from .proxy import PROXY_METHODS, VmProxy
from .vm import (
    TERMINAL,
    EmulatedVm,
    EmulatorClock,
    Faults,
    IdlePolicy,
    MicrovmFleet,
    ServiceError,
    VmState,
    not_found,
)

__all__ = ["MicrovmEmulator", "serve_in_thread"]

log = logging.getLogger(__name__)

API = "/2025-09-09"
_MAX_TOKEN_MINUTES = 60

Body = dict[str, Any]
Handler = Callable[[Request, Body], Awaitable[tuple[int, object]]]


class MicrovmEmulator:
    """The emulator: ``app`` is the Starlette application to serve.

    ``faults`` may be changed while serving (attributes, or ``POST /_emulator/faults``);
    ``calls`` records every control-plane call; ``clock.advance(s)`` moves idle
    timers and token expiry forward.
    """

    def __init__(
        self,
        *,
        base_dir: Path,
        faults: Faults | None = None,
        runner_command: Sequence[str] | None = None,
        runner_env: Mapping[str, str] | None = None,
        sweep_interval_s: float = 0.2,
        image_build_s: float = 0.5,
        account: str = "123456789012",
        region: str = "us-east-1",
    ) -> None:
        self.faults = faults or Faults()
        self.clock = EmulatorClock()
        self.fleet = MicrovmFleet(
            base_dir=base_dir, faults=self.faults, clock=self.clock, runner_env=runner_env
        )
        if runner_command is not None:
            self.fleet.runner_command = tuple(runner_command)
        self.images = ImageRegistry(arn_of=self._image_arn, clock=self.clock, build_s=image_build_s)
        self.proxy = VmProxy(self.fleet)
        self.calls: list[RecordedCall] = []
        self.client_tokens: dict[str, str] = {}
        self.sweep_interval_s = sweep_interval_s
        self.account = account
        self.region = region
        self.admin = EmulatorAdmin(
            faults=self.faults, fleet=self.fleet, clock=self.clock, calls=self.calls
        )
        self.app = Starlette(routes=self._routes(), lifespan=self._lifespan)

    def _routes(self) -> list[Route]:
        vm = API + "/microvms/{vm_id}"
        image = API + "/microvm-images/{image}"
        api = [
            ("POST", API + "/microvms", "RunMicrovm", self.run_microvm),
            ("GET", API + "/microvms", "ListMicrovms", self.list_microvms),
            ("GET", vm, "GetMicrovm", self.get_microvm),
            ("DELETE", vm, "TerminateMicrovm", self.terminate_microvm),
            ("POST", vm + "/suspend", "SuspendMicrovm", self.suspend_microvm),
            ("POST", vm + "/resume", "ResumeMicrovm", self.resume_microvm),
            ("POST", vm + "/auth-token", "CreateMicrovmAuthToken", self.create_auth_token),
            ("POST", API + "/microvm-images", "CreateMicrovmImage", self.create_image),
            ("GET", image, "GetMicrovmImage", self.get_image),
            ("GET", image + "/versions/{version}", "GetMicrovmImageVersion", self.get_version),
            ("GET", image + "/versions/{version}/builds", "ListMicrovmImageBuilds", self.builds),
        ]
        return [
            *(Route(path, self._api(h, op), methods=[m]) for m, path, op, h in api),
            Route("/vm/{vm_id}/{path:path}", self.proxy.handle, methods=PROXY_METHODS),
            Route("/vm/{vm_id}", self.proxy.handle, methods=PROXY_METHODS),
            *self.admin.routes(),
        ]

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.fleet.base_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        # Job UIDs traverse every ancestor of a runner's workspace root.
        os.chmod(self.fleet.base_dir, 0o711)  # noqa: S103
        timeout = httpx.Timeout(None, connect=2.0)
        async with (
            httpx.AsyncClient(timeout=timeout, trust_env=False) as self.proxy.client,
            anyio.create_task_group() as tasks,
        ):
            self.fleet.attach(tasks)
            tasks.start_soon(self._sweep_forever)
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await self.fleet.shutdown()
                tasks.cancel_scope.cancel()

    async def _sweep_forever(self) -> None:
        while True:
            await anyio.sleep(self.sweep_interval_s)
            try:
                await self.fleet.sweep()
            except Exception:
                log.exception("emulator: sweep failed")

    # -- the control-plane API ------------------------------------------------------------

    def _api(self, handler: Handler, operation: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            vm_id = request.path_params.get("vm_id")
            if self.faults.take_throttle(operation):
                self.calls.append(RecordedCall(operation, vm_id, throttled=True))
                return _error(ServiceError(429, "ThrottlingException", "Rate exceeded"))
            try:
                body = await _json_object(request)
                self.calls.append(RecordedCall(operation, vm_id, body.get("clientToken")))
                status, answer = await handler(request, body)
            except ServiceError as exc:
                return _error(exc)
            except ValueError:
                return _error(ServiceError(400, "ValidationException", "malformed JSON body"))
            return JSONResponse(answer, status_code=status)

        return endpoint

    def _vm(self, request: Request) -> EmulatedVm:
        vm = self.fleet.vms.get(request.path_params["vm_id"])
        if vm is None:
            raise not_found("MicroVM")
        return vm

    def _describe(self, request: Request, vm: EmulatedVm) -> dict[str, object]:
        return describe_vm(vm, f"{str(request.base_url).rstrip('/')}/vm/{vm.microvm_id}")

    def _image_arn(self, name: str) -> str:
        return f"arn:aws:lambda:{self.region}:{self.account}:microvm-image:{name}"

    async def run_microvm(self, request: Request, body: Body) -> tuple[int, object]:
        identifier = body.get("imageIdentifier")
        if not isinstance(identifier, str) or not identifier:
            raise ServiceError(400, "ValidationException", "imageIdentifier is required")
        token = body.get("clientToken")
        if token and token in self.client_tokens:
            # Idempotency: the same client token answers the VM it launched.
            return 200, self._describe(request, self.fleet.vms[self.client_tokens[token]])
        image = self.images.find(identifier)
        version = body.get("imageVersion") or (image.version if image else "1.0")
        if image is not None:
            self.images.runnable(image, version)
        arn = identifier if identifier.startswith("arn:") else self._image_arn(identifier)
        idle = body.get("idlePolicy")
        vm = self.fleet.launch(
            image_arn=image.arn if image else arn,
            image_version=version,
            image_env=image.env if image else {},
            idle=None
            if not idle
            else IdlePolicy(
                max_idle_s=int(idle["maxIdleDurationSeconds"]),
                suspended_s=int(idle["suspendedDurationSeconds"]),
                auto_resume=bool(idle["autoResumeEnabled"]),
            ),
            max_duration_s=int(body.get("maximumDurationInSeconds") or 28_800),
            run_hook_payload=body.get("runHookPayload"),
            execution_role_arn=body.get("executionRoleArn"),
            egress=body.get("egressNetworkConnectors") or (),
            ingress=body.get("ingressNetworkConnectors") or (),
        )
        if token:
            self.client_tokens[token] = vm.microvm_id
        return 200, self._describe(request, vm)

    async def get_microvm(self, request: Request, body: Body) -> tuple[int, object]:
        return 200, self._describe(request, self._vm(request))

    async def list_microvms(self, request: Request, body: Body) -> tuple[int, object]:
        image = request.query_params.get("imageIdentifier")
        items = [
            {
                "microvmId": vm.microvm_id,
                "state": vm.state.value,
                "imageArn": vm.image_arn,
                "imageVersion": vm.image_version,
                "startedAt": vm.started_at,
            }
            for vm in self.fleet.vms.values()
            if image is None or image in (vm.image_arn, vm.image_arn.rpartition(":")[2])
        ]
        return 200, {"items": items}

    async def terminate_microvm(self, request: Request, body: Body) -> tuple[int, object]:
        await self.fleet.terminate(self._vm(request), reason="TerminateMicrovm")
        return 200, {}

    async def suspend_microvm(self, request: Request, body: Body) -> tuple[int, object]:
        vm = self._vm(request)
        if vm.state is not VmState.RUNNING:
            raise ServiceError(409, "ConflictException", f"cannot suspend a {vm.state} MicroVM")
        self.fleet.suspend(vm)
        return 200, {}

    async def resume_microvm(self, request: Request, body: Body) -> tuple[int, object]:
        vm = self._vm(request)
        if vm.state is not VmState.SUSPENDED:
            raise ServiceError(409, "ConflictException", f"cannot resume a {vm.state} MicroVM")
        self.fleet.resume(vm)
        return 200, {}

    async def create_auth_token(self, request: Request, body: Body) -> tuple[int, object]:
        vm = self._vm(request)
        minutes = body.get("expirationInMinutes")
        if not isinstance(minutes, int) or not 1 <= minutes <= _MAX_TOKEN_MINUTES:
            raise ServiceError(400, "ValidationException", "expirationInMinutes must be 1..60")
        if vm.state in TERMINAL:
            raise ServiceError(409, "ConflictException", f"the MicroVM is {vm.state}")
        ports = _allowed_ports(body.get("allowedPorts"))
        value = self.proxy.tokens.mint(vm, minutes=minutes, ports=ports)
        return 200, {"authToken": {"X-aws-proxy-auth": value}}

    async def create_image(self, request: Request, body: Body) -> tuple[int, object]:
        return 201, self.images.create(body, fails=self.faults.image_build_fails)

    async def get_image(self, request: Request, body: Body) -> tuple[int, object]:
        return 200, self.images.describe(self.images.get(request.path_params["image"]))

    async def get_version(self, request: Request, body: Body) -> tuple[int, object]:
        params = request.path_params
        return 200, self.images.describe_version(params["image"], params["version"])

    async def builds(self, request: Request, body: Body) -> tuple[int, object]:
        return 200, self.images.builds(request.path_params["image"], request.path_params["version"])


def describe_vm(vm: EmulatedVm, endpoint: str) -> dict[str, object]:
    """The GetMicrovm / RunMicrovm answer."""
    answer: dict[str, object] = {
        "microvmId": vm.microvm_id,
        "state": vm.state.value,
        "endpoint": endpoint,
        "imageArn": vm.image_arn,
        "imageVersion": vm.image_version,
        "maximumDurationInSeconds": vm.max_duration_s,
        "startedAt": vm.started_at,
        "egressNetworkConnectors": list(vm.egress),
        "ingressNetworkConnectors": list(vm.ingress),
    }
    if vm.idle is not None:
        answer["idlePolicy"] = {
            "maxIdleDurationSeconds": vm.idle.max_idle_s,
            "suspendedDurationSeconds": vm.idle.suspended_s,
            "autoResumeEnabled": vm.idle.auto_resume,
        }
    if vm.execution_role_arn:
        answer["executionRoleArn"] = vm.execution_role_arn
    if vm.state_reason:
        answer["stateReason"] = vm.state_reason
    if vm.terminated_at is not None:
        answer["terminatedAt"] = vm.terminated_at
    return answer


async def _json_object(request: Request) -> Body:
    if request.method not in ("POST", "PUT") or not await request.body():
        return {}
    body = await request.json()
    if not isinstance(body, dict):
        raise ServiceError(400, "ValidationException", "the body must be a JSON object")
    return body


def _allowed_ports(specs: object) -> frozenset[int] | None:
    """The ports a token opens (None: all), from ``allowedPorts``."""
    if not isinstance(specs, list) or not specs:
        raise ServiceError(400, "ValidationException", "allowedPorts needs at least one entry")
    ports: set[int] = set()
    for spec in specs:
        if not isinstance(spec, dict) or len(spec) != 1:
            raise ServiceError(400, "ValidationException", "a port specification sets one member")
        if "allPorts" in spec:
            return None
        if "port" in spec:
            ports.add(int(spec["port"]))
        elif "range" in spec:
            ports.update(range(int(spec["range"]["startPort"]), int(spec["range"]["endPort"]) + 1))
    return frozenset(ports)


def _error(exc: ServiceError) -> Response:
    return JSONResponse(
        {"message": str(exc)}, status_code=exc.status, headers={"x-amzn-ErrorType": exc.code}
    )


@contextlib.contextmanager
def serve_in_thread(
    emulator: MicrovmEmulator, *, host: str = "127.0.0.1", port: int = 0
) -> Iterator[str]:
    """Serve ``emulator`` with uvicorn in a thread; yields its base URL. Stops on exit."""
    # An emulator served inside another process (a test, an embedder) leaves that
    # process's logging alone: uvicorn's dictConfig, a log level or access_log=False
    # each reconfigure the process-wide uvicorn loggers (access_log=False stops
    # uvicorn.access propagating for every later server in the process).
    config = uvicorn.Config(emulator.app, host=host, port=port, lifespan="on", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="microvm-emulator", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the MicroVM emulator did not start")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
