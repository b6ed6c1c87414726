"""A streamed /v1/run whose client goes away lets its turn's cleanup run to its end.

Starlette (ASGI 2.3, as uvicorn speaks) cancels the response's task group when the
client disconnects, and re-sends that cancellation while the generator is not
shielded. The generator used to ``task.cancel()`` the run and then await it: the
re-sent cancellation reached the run again, a second native one, which passes the
anyio shields its cleanup is under (releasing the session's lock, discarding a
launch), and the cleanup stopped half-way. The run here is a double whose cleanup,
under an anyio shield as the real ones are, waits for the test to let it go: the
disconnect comes, then the test waits for the stream to settle before it does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
from starlette.applications import Starlette

from sandcell_orchestrator.serve.contexts import ContextRoutes
from sandcell_protocol import contexts as cx
from sandcell_protocol import encode
from tests.fixtures.cancelling import disconnect_after_first_line


class _Execution:
    """``run_code`` that prints once, then runs until cancelled; its cleanup is held."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cleaning = asyncio.Event()
        self.go_on = asyncio.Event()
        self.cleaned = False

    async def run_code(self, *_: Any, on_event: Any, **__: Any) -> cx.ContextRunResult:
        on_event(cx.ContextStdoutEvent(data="hi\n"))
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            with anyio.CancelScope(shield=True):
                self.cleaning.set()
                await self.go_on.wait()
                self.cleaned = True
        raise AssertionError("never ends by itself")


async def _owns(_namespace: str, _session_id: str) -> bool:
    return True


async def _remember(*_: str) -> None:
    return None


async def test_a_gone_client_does_not_cut_the_runs_cleanup_short() -> None:
    execution = _Execution()
    routes = ContextRoutes(
        execution=lambda: execution,  # type: ignore[arg-type,return-value]
        namespace_of=lambda _: "tenant-a",
        remember=_remember,
        owns=_owns,
    )
    app = Starlette(routes=routes.routes())
    body = encode(cx.RunCall(language="python", code="print('hi')", user_id="alice"))
    sent = await disconnect_after_first_line(
        app, cleaning=execution.cleaning, go_on=execution.go_on, path="/v1/run", body=body
    )
    for _ in range(10):
        await asyncio.sleep(0)  # a cleanup left running on its own ends here
    assert sent[0]["status"] == 200
    assert execution.cleaned, "the run's cleanup was cut short by a second cancellation"
