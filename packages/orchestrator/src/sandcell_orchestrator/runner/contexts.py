"""The runner's code-context routes (``/v1/session/contexts``), one method per route.

``RunnerClient.contexts`` is one of these over the client's connection, so the
client keeps one method per route without growing past a readable size.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sandcell_protocol import ProtocolError, routes
from sandcell_protocol import contexts as cx

from ..errors import SandboxUnavailableError
from .answers import read_lines
from .connection import RunnerConnection
from .errors import refused_before_sending

__all__ = ["RUN_MARGIN_S", "RunnerContexts"]

RUN_MARGIN_S = 10.0
"""Read-timeout slack past a run's own deadline: the grace, the kill, the outputs."""


def _path(context_id: str, suffix: str = "") -> str:
    try:
        return cx.context_path(context_id, suffix)  # type: ignore[arg-type]
    except ValueError as exc:
        raise refused_before_sending("bad_request", str(exc)) from None


class RunnerContexts:
    """Create, list, run, interrupt, restart and delete the bound session's contexts."""

    def __init__(self, connection: RunnerConnection) -> None:
        self._conn = connection

    async def create(self, create: cx.ContextCreate, *, session_id: str) -> cx.ContextInfo:
        """``POST /v1/session/contexts``: start an interpreter."""
        response = await self._conn.request(
            "POST", cx.SESSION_CONTEXTS, session_id=session_id, message=create
        )
        return self._conn.decode(response, cx.ContextInfo)

    async def list(self, *, session_id: str) -> list[cx.ContextInfo]:
        """``GET /v1/session/contexts``."""
        response = await self._conn.request("GET", cx.SESSION_CONTEXTS, session_id=session_id)
        return self._conn.decode(response, cx.ContextList).contexts

    async def delete(self, context_id: str, *, session_id: str) -> None:
        """``DELETE /v1/session/contexts/{id}``."""
        await self._conn.request("DELETE", _path(context_id), session_id=session_id)

    async def restart(self, context_id: str, *, session_id: str) -> cx.ContextInfo:
        """``POST /v1/session/contexts/{id}/restart``: a fresh interpreter, same id."""
        response = await self._conn.request(
            "POST", _path(context_id, "restart"), session_id=session_id
        )
        return self._conn.decode(response, cx.ContextInfo)

    async def interrupt(self, context_id: str, *, session_id: str) -> cx.ContextInfo:
        """``POST /v1/session/contexts/{id}/interrupt``: SIGINT to the running cell."""
        response = await self._conn.request(
            "POST", _path(context_id, "interrupt"), session_id=session_id
        )
        return self._conn.decode(response, cx.ContextInfo)

    def _read_s(self, run: cx.ContextRun, timeout_s: float | None) -> float:
        if timeout_s is not None:
            return timeout_s
        own_s = (run.timeout_ms or self._conn.caps.max_timeout_ms) / 1000
        return max(self._conn.timeout_s, own_s + RUN_MARGIN_S)

    async def run(
        self,
        context_id: str,
        run: cx.ContextRun,
        *,
        session_id: str,
        timeout_s: float | None = None,
    ) -> cx.ContextRunResult:
        """``POST /v1/session/contexts/{id}/run``, answered as one object."""
        response = await self._conn.request(
            "POST",
            _path(context_id, "run"),
            session_id=session_id,
            message=run,
            read_timeout_s=self._read_s(run, timeout_s),
            max_bytes=lambda caps: caps.execute_bytes(),
        )
        return self._conn.decode(response, cx.ContextRunResult)

    async def run_stream(
        self,
        context_id: str,
        run: cx.ContextRun,
        *,
        session_id: str,
        timeout_s: float | None = None,
    ) -> AsyncIterator[cx.ContextEvent]:
        """The same run as NDJSON events, the ``ContextEndEvent`` last.

        Close the iterator (``contextlib.aclosing``) when leaving early.
        """
        route = _path(context_id, "run")
        read_s = self._read_s(run, timeout_s)
        response = await self._conn.request(
            "POST",
            route,
            session_id=session_id,
            message=run,
            extra_headers={"Accept": routes.NDJSON},
            read_timeout_s=read_s,
            stream=True,
        )
        # A run's own deadline (plus the margin) bounds the time its events take.
        lines = read_lines(
            response,
            max_line_bytes=self._conn.caps.execute_bytes(),
            budget_s=read_s,
            clock=self._conn.clock,
            where=f"POST {route}",
        )
        try:
            with self._conn.mapping(response.request):
                ended = False
                async for line in lines:
                    if not line.strip():
                        continue
                    try:
                        event = cx.decode_context_event(line)
                    except ProtocolError as exc:
                        raise SandboxUnavailableError(
                            f"POST {route}: malformed event: {exc}"
                        ) from None
                    ended = isinstance(event, cx.ContextEndEvent)
                    yield event
            if not ended:
                raise SandboxUnavailableError(f"POST {route}: stream ended before its end event")
        finally:
            await response.aclose()
