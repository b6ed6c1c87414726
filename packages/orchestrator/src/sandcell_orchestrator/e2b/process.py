"""envd's ``process.Process`` service, served from the generated code the ``e2b`` package ships.

``ProcessASGIApplication`` (generated from E2B's ``process.proto``, shipped in
``e2b.envd.process``) does the Connect protocol: JSON codec, server streams,
envelopes, deadlines. This module implements its ``Process`` protocol by
translating each call onto the runner's sandbox routes (``SandboxRunnerClient``):
a process runs in the sandbox's session jail, its output streamed as it comes.

The sandbox is the one the request names (``E2b-Sandbox-Id``) with its access
token (``X-Access-Token``); a wrong token reads as no sandbox. The create-time
``envVars`` are every process's base environment. ``Connect-Timeout-Ms`` of a
``Start`` bounds the process's life, as envd's does; a stream closed early
leaves the process running (reattach with ``Connect``).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from protobuf import Oneof

from sandcell_protocol import sandbox_messages as sm

from ..errors import SandcellError
from ..runner.sandbox import SandboxRunnerClient
from .codecs import strict_codecs
from .errors import connect_error
from .sandboxes import E2bSandbox

if TYPE_CHECKING:
    from connectrpc.request import RequestContext

__all__ = ["ProcessService", "process_app"]

log = logging.getLogger(__name__)

SandboxOf = Callable[["RequestContext[object, object]"], E2bSandbox]
_SIGNALS: dict[int, sm.SignalName] = {9: "SIGKILL", 15: "SIGTERM"}


def _runner(sandbox: E2bSandbox) -> SandboxRunnerClient:
    if sandbox.runner is None:
        raise ConnectError(Code.UNAVAILABLE, f"sandbox {sandbox.sandbox_id} is paused")
    return sandbox.runner


def _one(name: str, value: object) -> Any:
    """A protobuf oneof value (the generated types spell each case as a literal)."""
    return Oneof(name, value)


def _event(event: sm.ProcessEvent) -> pb.ProcessEvent:
    """A runner event as envd's ``ProcessEvent``."""
    if isinstance(event, sm.ProcessStarted):
        return pb.ProcessEvent(event=_one("start", pb.ProcessEvent.StartEvent(pid=event.pid)))
    if isinstance(event, sm.ProcessOutput):
        data = base64.b64decode(event.data)
        output = _one(event.stream, data)
        return pb.ProcessEvent(event=_one("data", pb.ProcessEvent.DataEvent(output=output)))
    if isinstance(event, sm.ProcessEnded):
        end = pb.ProcessEvent.EndEvent(
            exit_code=event.exit_code if event.exit_code is not None else -1,
            exited=event.exit_code is not None,
            status=event.status,
            error=event.error,
        )
        return pb.ProcessEvent(event=_one("end", end))
    return pb.ProcessEvent(event=_one("keepalive", pb.ProcessEvent.KeepAlive()))


async def _selected_pid(runner: SandboxRunnerClient, selector: pb.ProcessSelector | None) -> int:
    chosen = selector.selector if selector is not None else None
    match chosen:
        case Oneof(field="pid", value=pid):
            return int(pid)
        case Oneof(field="tag", value=tag):
            for info in await runner.list_processes():
                if info.tag == tag:
                    return info.pid
            raise ConnectError(Code.NOT_FOUND, f"process with tag {str(tag)[:80]!r} not found")
    raise ConnectError(Code.INVALID_ARGUMENT, "process: a pid or a tag is required")


class ProcessService:
    """``process.Process`` over the runner's sandbox routes."""

    def __init__(self, sandbox_of: SandboxOf) -> None:
        self._sandbox_of = sandbox_of

    def _runner(self, ctx: RequestContext[object, object]) -> SandboxRunnerClient:
        return _runner(self._sandbox_of(ctx))

    async def list(
        self, request: pb.ListRequest, ctx: RequestContext[pb.ListRequest, pb.ListResponse], /
    ) -> pb.ListResponse:
        try:
            infos = await self._runner(ctx).list_processes()  # type: ignore[arg-type]
        except SandcellError as exc:
            raise connect_error(exc) from None
        return pb.ListResponse(
            processes=[
                pb.ProcessInfo(
                    config=pb.ProcessConfig(
                        cmd=info.cmd, args=info.args, envs=info.envs, cwd=info.cwd
                    ),
                    pid=info.pid,
                    tag=info.tag,
                )
                for info in infos
            ]
        )

    async def start(
        self, request: pb.StartRequest, ctx: RequestContext[pb.StartRequest, pb.StartResponse], /
    ) -> AsyncIterator[pb.StartResponse]:
        sandbox = self._sandbox_of(ctx)  # type: ignore[arg-type]
        config = request.process or pb.ProcessConfig()
        pty = None
        if request.pty is not None and request.pty.size is not None:
            pty = sm.PtySize(cols=request.pty.size.cols, rows=request.pty.size.rows)
        remaining_ms = ctx.timeout_ms
        try:
            start = sm.SandboxProcessStart(
                cmd=config.cmd,
                args=list(config.args or []),
                envs={**sandbox.env, **(config.envs or {})},
                cwd=config.cwd or None,
                tag=request.tag or None,
                stdin=bool(request.stdin),
                pty=pty,
                timeout_ms=max(1, int(remaining_ms)) if remaining_ms is not None else None,
            )
        except Exception as exc:  # msgspec's constraint checks
            raise ConnectError(Code.INVALID_ARGUMENT, f"process: {exc}") from None
        try:
            events = await _runner(sandbox).start(start)
            async for event in events:
                yield pb.StartResponse(event=_event(event))
        except SandcellError as exc:
            raise connect_error(exc) from None

    async def connect(
        self,
        request: pb.ConnectRequest,
        ctx: RequestContext[pb.ConnectRequest, pb.ConnectResponse],
        /,
    ) -> AsyncIterator[pb.ConnectResponse]:
        runner = self._runner(ctx)  # type: ignore[arg-type]
        try:
            pid = await _selected_pid(runner, request.process)
            events = await runner.attach(pid)
            async for event in events:
                yield pb.ConnectResponse(event=_event(event))
        except SandcellError as exc:
            raise connect_error(exc) from None

    async def update(
        self, request: pb.UpdateRequest, ctx: RequestContext[pb.UpdateRequest, pb.UpdateResponse], /
    ) -> pb.UpdateResponse:
        runner = self._runner(ctx)  # type: ignore[arg-type]
        try:
            pid = await _selected_pid(runner, request.process)
            if request.pty is not None and request.pty.size is not None:
                size = request.pty.size
                await runner.resize(pid, sm.PtySize(cols=size.cols, rows=size.rows))
        except SandcellError as exc:
            raise connect_error(exc) from None
        return pb.UpdateResponse()

    async def stream_input(
        self,
        request: AsyncIterator[pb.StreamInputRequest],
        ctx: RequestContext[pb.StreamInputRequest, pb.StreamInputResponse],
        /,
    ) -> pb.StreamInputResponse:
        runner = self._runner(ctx)  # type: ignore[arg-type]
        pid: int | None = None
        try:
            async for message in request:
                event = message.event.value if message.event is not None else None
                if isinstance(event, pb.StreamInputRequest.StartEvent):
                    pid = await _selected_pid(runner, event.process)
                elif isinstance(event, pb.StreamInputRequest.DataEvent):
                    if pid is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "data before start")
                    await runner.send_input(pid, _input_bytes(event.input))
        except SandcellError as exc:
            raise connect_error(exc) from None
        return pb.StreamInputResponse()

    async def send_input(
        self,
        request: pb.SendInputRequest,
        ctx: RequestContext[pb.SendInputRequest, pb.SendInputResponse],
        /,
    ) -> pb.SendInputResponse:
        runner = self._runner(ctx)  # type: ignore[arg-type]
        try:
            pid = await _selected_pid(runner, request.process)
            await runner.send_input(pid, _input_bytes(request.input))
        except SandcellError as exc:
            raise connect_error(exc) from None
        return pb.SendInputResponse()

    async def send_signal(
        self,
        request: pb.SendSignalRequest,
        ctx: RequestContext[pb.SendSignalRequest, pb.SendSignalResponse],
        /,
    ) -> pb.SendSignalResponse:
        runner = self._runner(ctx)  # type: ignore[arg-type]
        name = _SIGNALS.get(int(request.signal.value) if request.signal is not None else 0)
        if name is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "signal: SIGTERM or SIGKILL")
        try:
            pid = await _selected_pid(runner, request.process)
            await runner.signal(pid, name)
        except SandcellError as exc:
            raise connect_error(exc) from None
        return pb.SendSignalResponse()

    async def close_stdin(
        self,
        request: pb.CloseStdinRequest,
        ctx: RequestContext[pb.CloseStdinRequest, pb.CloseStdinResponse],
        /,
    ) -> pb.CloseStdinResponse:
        runner = self._runner(ctx)  # type: ignore[arg-type]
        try:
            pid = await _selected_pid(runner, request.process)
            await runner.close_stdin(pid)
        except SandcellError as exc:
            raise connect_error(exc) from None
        return pb.CloseStdinResponse()


def _input_bytes(message: pb.ProcessInput | None) -> bytes:
    match message.input if message is not None else None:
        case Oneof(field="stdin", value=data) | Oneof(field="pty", value=data):
            return bytes(data)
    raise ConnectError(Code.INVALID_ARGUMENT, "input: stdin or pty bytes are required")


def process_app(sandbox_of: SandboxOf) -> ProcessASGIApplication:
    """The Connect ASGI app of ``process.Process`` (mount where ``/process.Process/…`` lands)."""
    return ProcessASGIApplication(ProcessService(sandbox_of), codecs=strict_codecs())  # type: ignore[arg-type]
