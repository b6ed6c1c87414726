"""Routes of a session's app features: processes, logs, runtime errors, analysis.

All are session-bound (``X-Runtime-Session-Id`` required, sessions enabled) and
need the bearer token, like every route. Only starting a process and running the
analysis take the session lock (they use the workspace); listing, logs, stdin
and stopping do not, so a dev server stays reachable while a long command runs
in the same session. The preview of a session's ports is ``http/preview.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from sandcell_protocol import app_messages as am
from sandcell_protocol import encode, redact_message, redact_secrets, routes
from sandcell_protocol.digits import is_ascii_digits

from ..apps import logfilter
from ..apps.runtime_errors import from_browser
from ..errors import BadRequestError
from .base import RouteGroup, json_response

_MAX_LOG_LINES = 10_000
_MAX_STDIN_BYTES = 1024 * 1024


class AppRoutes(RouteGroup):
    """Processes, logs, runtime errors and analysis of the bound session."""

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(routes.SESSION_PROCESSES, g(self.post_process), methods=["POST"]),
            Route(routes.SESSION_PROCESSES, g(self.list_processes), methods=["GET"]),
            Route(am.SESSION_PROCESS, g(self.delete_process), methods=["DELETE"]),
            Route(am.SESSION_PROCESS_LOGS, g(self.get_logs), methods=["GET"]),
            Route(am.SESSION_PROCESS_STDIN, g(self.post_stdin), methods=["POST"]),
            Route(routes.SESSION_RUNTIME_ERRORS, g(self.post_runtime_error), methods=["POST"]),
            Route(routes.SESSION_RUNTIME_ERRORS, g(self.get_runtime_errors), methods=["GET"]),
            Route(routes.SESSION_RUNTIME_ERRORS, g(self.delete_runtime_errors), methods=["DELETE"]),
            Route(routes.SESSION_ANALYSIS, g(self.get_analysis), methods=["GET"]),
        ]

    @staticmethod
    def _tag(request: Request) -> str:
        tag = str(request.path_params["tag"])
        if not am.is_process_tag(tag):
            raise BadRequestError(f"process tag must match {am.PROCESS_TAG_RULE}")
        return tag

    # -- processes ------------------------------------------------------------------

    async def post_process(self, request: Request) -> Response:
        session_id = self.required_session(request)
        start = await self.read_message(request, am.ProcessStart)
        async with self.sessions.locked(session_id) as state:
            app = self.service.apps.get(state)
            info = await app.processes.start(start, self.service.apps.target(state))
        return json_response(info, 201)

    async def list_processes(self, request: Request) -> Response:
        _, app = await self.bound_app(request)
        return json_response(am.ProcessList(processes=app.processes.list()))

    async def delete_process(self, request: Request) -> Response:
        _, app = await self.bound_app(request)
        return json_response(await app.processes.stop(self._tag(request)))

    async def post_stdin(self, request: Request) -> Response:
        _, app = await self.bound_app(request)
        tag = self._tag(request)
        data = await self.read_body(request, max_bytes=_MAX_STDIN_BYTES)
        close = request.query_params.get("eof") in ("1", "true")
        await app.processes.write_stdin(tag, data, close=close)
        return Response(status_code=204)

    async def get_logs(self, request: Request) -> Response:
        _, app = await self.bound_app(request)
        tag = self._tag(request)
        buffer = app.processes.buffer(tag)
        follow = request.query_params.get("follow") in ("1", "true")
        count = _int_param(request, "lines", default=10 if follow else 100)
        pattern = request.query_params.get("filter")
        if pattern is not None:
            logfilter.validate_pattern(pattern)
        snapshot = buffer.snapshot()
        mask = None
        if pattern is not None:
            mask = await logfilter.match_lines(pattern, snapshot.texts)
        tail = snapshot.tail(count, mask)
        # Logs are diagnostics an agent reads: credentials in them are redacted.
        shown = [redact_secrets(line) for line in tail.lines]
        if not follow:
            return json_response(am.LogLines(tag=tag, lines=shown, truncated=tail.truncated))
        follower = buffer.follow()

        async def stream() -> AsyncIterator[bytes]:
            for line in shown:
                yield encode(am.LogLine(line=line)) + b"\n"
            lines = follower.lines()
            if pattern is not None:
                lines = logfilter.filter_stream(pattern, lines)
            try:
                async for line in lines:
                    yield encode(am.LogLine(line=redact_secrets(line))) + b"\n"
            finally:
                follower.close()

        return StreamingResponse(stream(), media_type=routes.NDJSON)

    # -- runtime errors -----------------------------------------------------------

    async def post_runtime_error(self, request: Request) -> Response:
        _, app = await self.bound_app(request)
        report = await self.read_message(request, am.RuntimeErrorReport)
        app.errors.record(from_browser(report))
        return Response(status_code=204)

    async def get_runtime_errors(self, request: Request) -> Response:
        _, app = await self.bound_app(request)
        raw = request.query_params.get("since")
        since = None
        if raw is not None:
            try:
                since = float(raw)
            except ValueError:
                raise BadRequestError("since must be a number of epoch seconds") from None
        return json_response(am.RuntimeErrors(errors=app.errors.since(since)))

    async def delete_runtime_errors(self, request: Request) -> Response:
        _, app = await self.bound_app(request)
        app.errors.clear()
        return Response(status_code=204)

    # -- analysis -------------------------------------------------------------------

    async def get_analysis(self, request: Request) -> Response:
        analysis = await self.service.analyse(self.required_session(request))
        return json_response(redact_message(analysis))


def _int_param(request: Request, name: str, *, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not is_ascii_digits(raw, max_length=9) or int(raw) > _MAX_LOG_LINES:
        raise BadRequestError(f"{name} must be an integer 0..{_MAX_LOG_LINES}")
    return int(raw)


__all__ = ["AppRoutes"]
