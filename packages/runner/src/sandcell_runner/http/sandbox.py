"""Routes of a session's sandbox features: interactive processes, filesystem calls, metrics.

Session-bound (``X-Runtime-Session-Id``) and behind the bearer token like every
route. Starting a process and filesystem calls take the session lock briefly
(they use the workspace); the event streams, input, signals and resizes do not,
so a long-running process stays reachable while other calls run.

    POST /v1/session/sandbox/processes                 SandboxProcessStart -> NDJSON events
    GET  /v1/session/sandbox/processes                 SandboxProcessList
    GET  /v1/session/sandbox/processes/{pid}/events    NDJSON events (reattach)
    POST /v1/session/sandbox/processes/{pid}/input     raw bytes -> 204
    POST /v1/session/sandbox/processes/{pid}/close-stdin   204
    POST /v1/session/sandbox/processes/{pid}/signal    ProcessSignal -> 204
    POST /v1/session/sandbox/processes/{pid}/pty       PtyResize -> 204
    POST /v1/session/sandbox/fs                        FsRequest -> FsResult
    POST /v1/session/sandbox/metrics                   MetricsQuery -> SandboxMetrics

An event stream carries a ``ProcessKeepalive`` line whenever the process has
been quiet for ``KEEPALIVE_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from sandcell_protocol import ProtocolError, encode, routes
from sandcell_protocol import sandbox_messages as sm

from ..errors import BadRequestError
from ..sandbox.fs import WorkspaceFs, run_fs
from ..sandbox.processes import SandboxProcesses
from .base import RouteGroup, json_response

KEEPALIVE_S = 15.0
_MAX_INPUT_BYTES = 1024 * 1024


class SandboxRoutes(RouteGroup):
    """Interactive processes, filesystem calls and metrics of the bound session."""

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(sm.SANDBOX_PROCESSES, g(self.start), methods=["POST"]),
            Route(sm.SANDBOX_PROCESSES, g(self.list), methods=["GET"]),
            Route(sm.SANDBOX_PROCESS_EVENTS, g(self.events), methods=["GET"]),
            Route(sm.SANDBOX_PROCESS_INPUT, g(self.input), methods=["POST"]),
            Route(sm.SANDBOX_PROCESS_CLOSE_STDIN, g(self.close_stdin), methods=["POST"]),
            Route(sm.SANDBOX_PROCESS_SIGNAL, g(self.signal), methods=["POST"]),
            Route(sm.SANDBOX_PROCESS_PTY, g(self.resize), methods=["POST"]),
            Route(sm.SANDBOX_FS, g(self.fs), methods=["POST"]),
            Route(sm.SANDBOX_METRICS, g(self.metrics), methods=["POST"]),
        ]

    async def _processes(self, request: Request) -> SandboxProcesses:
        state = await self.sessions.bind(self.required_session(request))
        return self.service.sandbox.processes(state)

    async def start(self, request: Request) -> Response:
        session_id = self.required_session(request)
        start = await self.read_message(request, sm.SandboxProcessStart)
        async with self.sessions.locked(session_id) as state:
            processes = self.service.sandbox.processes(state)
            events = await processes.start(
                start, self.service.sandbox.target(state), timeout_ms=start.timeout_ms
            )
        return _stream(events)

    async def list(self, request: Request) -> Response:
        processes = await self._processes(request)
        return json_response(sm.SandboxProcessList(processes=processes.list()))

    async def events(self, request: Request) -> Response:
        processes = await self._processes(request)
        return _stream(processes.attach(int(request.path_params["pid"])))

    async def input(self, request: Request) -> Response:
        processes = await self._processes(request)
        data = await self.read_body(request, max_bytes=_MAX_INPUT_BYTES)
        await processes.write_input(int(request.path_params["pid"]), data)
        return Response(status_code=204)

    async def close_stdin(self, request: Request) -> Response:
        processes = await self._processes(request)
        processes.close_stdin(int(request.path_params["pid"]))
        return Response(status_code=204)

    async def signal(self, request: Request) -> Response:
        processes = await self._processes(request)
        message = await self.read_message(request, sm.ProcessSignal)
        processes.signal(int(request.path_params["pid"]), message.signal)
        return Response(status_code=204)

    async def resize(self, request: Request) -> Response:
        processes = await self._processes(request)
        message = await self.read_message(request, sm.PtyResize)
        processes.resize(int(request.path_params["pid"]), message.size)
        return Response(status_code=204)

    async def fs(self, request: Request) -> Response:
        session_id = self.required_session(request)
        try:
            call = sm.decode_fs_request(await self.read_body(request))
        except ProtocolError as exc:
            raise BadRequestError(str(exc)) from None
        async with self.sessions.locked(session_id) as state:
            fs = WorkspaceFs(state.workspace, uid=state.uid)
            result = await asyncio.to_thread(run_fs, fs, call)
        return json_response(result)

    async def metrics(self, request: Request) -> Response:
        # Bound as every sandbox route binds (a sandbox nothing ran in yet has a workspace
        # to measure too); the ring is read without the session lock.
        state = await self.sessions.bind(self.required_session(request))
        query = await self.read_message(request, sm.MetricsQuery)
        return json_response(self.service.metrics.query(state.session_id, query))


def _stream(events: AsyncIterator[sm.ProcessEvent]) -> StreamingResponse:
    async def lines() -> AsyncIterator[bytes]:
        iterator = aiter(events)
        pending: asyncio.Task[sm.ProcessEvent] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(iterator))
                done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
                if not done:
                    yield encode(sm.ProcessKeepalive()) + b"\n"
                    continue
                try:
                    event = pending.result()
                except StopAsyncIteration:
                    return
                finally:
                    pending = None
                yield encode(event) + b"\n"
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            closer = getattr(iterator, "aclose", None)
            if closer is not None:
                await closer()

    return StreamingResponse(lines(), media_type=routes.NDJSON)


__all__ = ["KEEPALIVE_S", "SandboxRoutes"]
