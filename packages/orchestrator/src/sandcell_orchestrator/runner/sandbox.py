"""``SandboxRunnerClient``: a runner's sandbox routes (interactive processes, filesystem).

A thin wrapper over a ``RunnerClient``'s one ``RunnerConnection`` (bearer token,
``X-Runtime-Session-Id``, protocol check, error maps, redactor), bound to one
runtime session, like ``AppRunnerClient``. It owns nothing: the handle's
``RunnerClient`` stays its owner's.

Event streams are NDJSON ``ProcessEvent`` lines; the runner sends a keepalive
line while a process is quiet, so the read timeout only has to outlast that.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from sandcell_protocol import ProtocolError
from sandcell_protocol import sandbox_messages as sm

from ..errors import SandboxUnavailableError
from ..handle import SandboxHandle
from .answers import read_lines
from .client import RunnerClient
from .connection import RunnerConnection

__all__ = ["SandboxRunnerClient"]

_STREAM_READ_S = 120.0
"""Past the runner's keepalive interval (15 s): a silent stream means a lost runner."""
_OCTET_STREAM = "application/octet-stream"


def _route(template: str, pid: int) -> str:
    return template.replace("{pid:int}", str(int(pid)))


class SandboxRunnerClient:
    """One runner's sandbox routes in one runtime session."""

    def __init__(self, runner: RunnerClient, *, session_id: str) -> None:
        self._runner = runner
        self.session_id = session_id

    @classmethod
    def for_handle(cls, handle: SandboxHandle) -> SandboxRunnerClient:
        """The sandbox routes of ``handle``'s runner, in ``handle``'s session."""
        if handle.session_id is None:
            raise SandboxUnavailableError("sandbox routes need a handle bound to a session")
        return cls(handle.runner, session_id=handle.session_id)

    def __repr__(self) -> str:
        return f"SandboxRunnerClient(base_url={self._runner.base_url!r})"

    @property
    def _conn(self) -> RunnerConnection:
        if self._runner.is_closed:
            raise SandboxUnavailableError("this sandbox's runner client is closed")
        return self._runner.connection

    # -- processes ------------------------------------------------------------------

    async def start(self, start: sm.SandboxProcessStart) -> AsyncIterator[sm.ProcessEvent]:
        """``POST …/sandbox/processes``: the new process's events, ``ProcessStarted`` first.

        Refusals (a bad cwd, too many processes) raise before anything is yielded.
        Close the iterator (``contextlib.aclosing``) when leaving early; the
        process keeps running.
        """
        response = await self._conn.request(
            "POST",
            sm.SANDBOX_PROCESSES,
            session_id=self.session_id,
            message=start,
            read_timeout_s=_STREAM_READ_S,
            stream=True,
        )
        return self._events(response)

    async def attach(self, pid: int) -> AsyncIterator[sm.ProcessEvent]:
        """``GET …/processes/{pid}/events``: a running process's events from now on."""
        response = await self._conn.request(
            "GET",
            _route(sm.SANDBOX_PROCESS_EVENTS, pid),
            session_id=self.session_id,
            read_timeout_s=_STREAM_READ_S,
            stream=True,
        )
        return self._events(response)

    async def _events(self, response: httpx.Response) -> AsyncIterator[sm.ProcessEvent]:
        conn = self._conn
        try:
            # Each line bounded; the stream itself may last as long as the process
            # (the runner's keepalives and the read timeout bound a silence).
            lines = read_lines(
                response,
                max_line_bytes=conn.caps.event_line_bytes,
                budget_s=None,
                clock=conn.clock,
                where="process events",
            )
            with conn.mapping(response.request):
                async for line in lines:
                    if not line.strip():
                        continue
                    try:
                        event = sm.decode_process_event(line)
                    except ProtocolError as exc:
                        raise SandboxUnavailableError(f"malformed process event: {exc}") from None
                    yield event
        finally:
            await response.aclose()

    async def list_processes(self) -> list[sm.SandboxProcessInfo]:
        """``GET …/sandbox/processes``: the running processes."""
        response = await self._conn.request("GET", sm.SANDBOX_PROCESSES, session_id=self.session_id)
        return self._conn.decode(response, sm.SandboxProcessList).processes

    async def send_input(self, pid: int, data: bytes) -> None:
        """``POST …/processes/{pid}/input``: bytes to its stdin (its terminal for a PTY)."""
        await self._conn.request(
            "POST",
            _route(sm.SANDBOX_PROCESS_INPUT, pid),
            session_id=self.session_id,
            content=data,
            extra_headers={"Content-Type": _OCTET_STREAM},
        )

    async def close_stdin(self, pid: int) -> None:
        """``POST …/processes/{pid}/close-stdin``."""
        await self._conn.request(
            "POST", _route(sm.SANDBOX_PROCESS_CLOSE_STDIN, pid), session_id=self.session_id
        )

    async def signal(self, pid: int, signal: sm.SignalName) -> None:
        """``POST …/processes/{pid}/signal``."""
        await self._conn.request(
            "POST",
            _route(sm.SANDBOX_PROCESS_SIGNAL, pid),
            session_id=self.session_id,
            message=sm.ProcessSignal(signal=signal),
        )

    async def resize(self, pid: int, size: sm.PtySize) -> None:
        """``POST …/processes/{pid}/pty``: resize its terminal."""
        await self._conn.request(
            "POST",
            _route(sm.SANDBOX_PROCESS_PTY, pid),
            session_id=self.session_id,
            message=sm.PtyResize(size=size),
        )

    # -- filesystem -------------------------------------------------------------------

    async def fs(self, request: sm.FsRequest) -> sm.FsResult:
        """``POST …/sandbox/fs``: one filesystem call on the session workspace."""
        response = await self._conn.request(
            "POST",
            sm.SANDBOX_FS,
            session_id=self.session_id,
            message=request,
            max_bytes=lambda caps: caps.fs_bytes,
        )
        return self._conn.decode(response, sm.FsResult)

    # -- metrics ------------------------------------------------------------------------

    async def metrics(self, query: sm.MetricsQuery) -> sm.SandboxMetrics:
        """``POST …/sandbox/metrics``: the session's samples in the query's range."""
        response = await self._conn.request(
            "POST", sm.SANDBOX_METRICS, session_id=self.session_id, message=query
        )
        return self._conn.decode(response, sm.SandboxMetrics)
