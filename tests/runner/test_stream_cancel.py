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
    body_sent = asyncio.Event()
    ended_with_run_done: list[bool] = []

    async def receive() -> dict[str, Any]:
        await body_sent.wait()  # the first line is out: now the client goes
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            body_sent.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}

    async def serve() -> None:
        await response(scope, receive, send)
        ended_with_run_done.append(run.done())

    served = asyncio.create_task(serve())
    async with asyncio.timeout(30):
        await double.cleaning.wait()
    # The disconnect has cancelled the stream; whatever it and Starlette do next
    # happens in these loop iterations, while the cleanup is held.
    for _ in range(50):
        await asyncio.sleep(0)
    double.go_on.set()
    async with asyncio.timeout(30):
        await asyncio.wait({served})
        await asyncio.wait({run})
    assert not double.interrupted, "the run was cancelled again in its cleanup"
    assert double.cleaned
    assert ended_with_run_done == [True], "the stream ended before the run's cleanup"
