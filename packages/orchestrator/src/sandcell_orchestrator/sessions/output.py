"""Running one job in a sandbox, its output handed on as it is produced.

``ExecutionService`` calls ``run_job`` for every turn. The runner streams NDJSON
and, given an ``OnOutput`` callback, each stdout/stderr chunk goes to it the moment it arrives,
so a CLI or an HTTP client sees a line printed before a long sleep before the
job ends. So does each connection the sandbox's egress policy refused the job
(``EgressRefusedEvent``, with its destination; past the runner's per-turn limit one
``EgressOmittedEvent`` counts the rest): the runner sends them because this
orchestrator announces protocol 1.2. The result is the same either way (the
runner renders both from one execute), so the session logic around it does not
care which was used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from sandcell_protocol import (
    ExecuteRequest,
    ExecuteResult,
    OutputFile,
    ResultEvent,
    TurnEvent,
)

from ..errors import SandboxUnavailableError
from ..handle import SandboxHandle

__all__ = ["Collect", "OnOutput", "run_job"]

OnOutput = Callable[[TurnEvent], None]
"""Receives each output chunk as the job produces it, and each egress refusal as the
runner reports it (called on the event loop)."""
Collect = Callable[[SandboxHandle, list[OutputFile]], Awaitable[None]]
"""Called with the sandbox (bound to a session, so its files can be read) and the
turn's output files after the job and before the sandbox is released or discarded:
a surface reads there what the runner did not inline (``content_b64`` None)."""


async def run_job(
    handle: SandboxHandle,
    request: ExecuteRequest,
    *,
    session_id: str | None,
    timeout_s: float,
    on_output: OnOutput | None,
) -> ExecuteResult:
    """Execute ``request`` in ``handle``'s runner; stream its output to ``on_output``.

    Always over the stream, even with nobody to hand output to: closing it early
    (a cancelled turn) makes the runner stop the job, which a dropped plain
    request does not.
    """
    async with contextlib.aclosing(
        handle.runner.execute_stream(request, session_id=session_id, timeout_s=timeout_s)
    ) as events:
        async for event in events:
            if isinstance(event, ResultEvent):
                return event.result
            if on_output is not None:
                on_output(event)
    raise SandboxUnavailableError("the runner's stream ended before its result")
