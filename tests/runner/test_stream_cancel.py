"""A streamed /execute whose client goes away waits for its run's cleanup, once cancelled.

Starlette (ASGI 2.3, as uvicorn speaks) cancels the response's task group when the
client disconnects, and re-sends that cancellation while the generator is not
shielded. The generator's ``finally`` used to cancel the run and then ``await`` it:
the re-sent cancellation of the awaiting generator went on to the run, a second one
in the middle of its cleanup (the slot, the workspace, the session lock), and the
stream ended before that cleanup did. The run here is a double whose cleanup waits
for the test to let it go.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import StreamingResponse

from sandcell_runner.http.execute import _events
from tests.fixtures.cancelling import disconnect_after_first_line


class _Run:
    """Runs until cancelled; its cleanup then waits for ``go_on``."""

    def __init__(self) -> None:
        self.cleaning = asyncio.Event()
        self.go_on = asyncio.Event()
        self.cleaned = False
        self.interrupted = False

    async def __call__(self) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cleaning.set()
            try:
                await self.go_on.wait()
            except asyncio.CancelledError:
                self.interrupted = True
                raise
            self.cleaned = True
            raise
        raise AssertionError("never ends by itself")


async def test_a_gone_client_cancels_the_run_once_and_waits_for_its_cleanup() -> None:
    double = _Run()
    run = asyncio.ensure_future(double())
    queue: asyncio.Queue[Any] = asyncio.Queue()
    queue.put_nowait(("stdout", b"hi\n"))
    response = StreamingResponse(_events(queue, run, None, None))  # type: ignore[arg-type]
    ended_with_run_done: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await response(scope, receive, send)
        ended_with_run_done.append(run.done())

    await disconnect_after_first_line(app, cleaning=double.cleaning, go_on=double.go_on)
    async with asyncio.timeout(30):
        await asyncio.wait({run})
    assert not double.interrupted, "the run was cancelled again in its cleanup"
    assert double.cleaned
    assert ended_with_run_done == [True], "the stream ended before the run's cleanup"
