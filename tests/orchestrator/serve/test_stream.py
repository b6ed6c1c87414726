"""``POST /v1/exec`` with ``Accept: application/x-ndjson``: output as it happens, result last;
a client that leaves takes its turn with it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx
import msgspec

from sandcell_protocol import (
    ErrorCode,
    ExecuteResult,
    ResultEvent,
    RunStatus,
    StderrEvent,
    StdoutEvent,
    decode,
    decode_event,
)

from .test_serve import KEY_A, Service, error_of, service, start_service

__all__ = ["service", "start_service"]

NDJSON = {"Accept": "application/x-ndjson", "Authorization": f"Bearer {KEY_A}"}
EARLY_THEN_SLEEP = (
    "import sys, time\n"
    "print('early', flush=True)\n"
    "print('note', file=sys.stderr, flush=True)\n"
    "time.sleep(1.5)\n"
    "print('end', time.time())\n"
)


def body(code: str, hint: str | None = "st") -> dict[str, object]:
    payload: dict[str, object] = {"language": "python", "user_id": "alice", "code": code}
    if hint is not None:
        payload["runtime_session_hint"] = hint
    return payload


async def test_output_arrives_before_the_job_ends(service: Service) -> None:
    """A line printed before a sleep reaches the client before the job has ended (the job's
    own end time, printed last, is later than when the client got the line); the events are
    stdout/stderr chunks then exactly one result, last."""
    events: list[StdoutEvent | StderrEvent | ResultEvent] = []
    early_at_s = None
    async with service.client.stream(
        "POST", "/v1/exec", json=body(EARLY_THEN_SLEEP), headers=NDJSON
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        async for line in response.aiter_lines():
            if not line:
                continue
            event = decode_event(line)
            events.append(event)
            if isinstance(event, StdoutEvent) and "early" in event.data and early_at_s is None:
                early_at_s = time.time()
    assert isinstance(events[-1], ResultEvent)
    assert not any(isinstance(event, ResultEvent) for event in events[:-1])
    result = events[-1].result
    assert result.status == RunStatus.OK
    streamed = "".join(e.data for e in events if isinstance(e, StdoutEvent))
    assert streamed == result.stdout
    assert "".join(e.data for e in events if isinstance(e, StderrEvent)) == "note\n"
    job_end_s = float(result.stdout.split()[-1])
    assert early_at_s is not None
    assert early_at_s < job_end_s


async def test_a_refusal_before_any_output_is_a_plain_error(service: Service) -> None:
    """While a streamed turn runs, a second call on its session is a 409 session_busy
    ErrorBody with its status, not a 200 stream."""
    async with service.client.stream(
        "POST", "/v1/exec", json=body(EARLY_THEN_SLEEP, hint="busy"), headers=NDJSON
    ) as response:
        lines = response.aiter_lines()
        assert "early" in await anext(lines)
        second = await service.client.post(
            "/v1/exec", json=body("print(1)", hint="busy"), headers=NDJSON
        )
        assert second.status_code == 409
        assert error_of(second).error.code == ErrorCode.SESSION_BUSY
        assert second.headers["retry-after"] == "1"
        async for _ in lines:
            pass


async def _exec_until_free(service: Service, code: str, hint: str) -> ExecuteResult:
    """The cancelled turn releases its session as it cleans up; wait for that (bounded)."""
    for _ in range(200):
        response = await service.exec(code=code, runtime_session_hint=hint)
        if response.status_code != 409:
            assert response.status_code == 200, response.text
            return decode(response.content, ExecuteResult)
        await asyncio.sleep(0.1)
    raise AssertionError("the session stayed busy")


async def test_a_client_that_leaves_cancels_its_turn(service: Service) -> None:
    """Disconnecting mid-turn (streamed or not) stops the job (its session is free long
    before the job's 60 s sleep ends), and the session keeps what the job wrote before
    it was stopped, as after a timeout."""
    keep = await service.exec(code="open('kept', 'w').write('1')", runtime_session_hint="gone")
    assert keep.status_code == 200, keep.text
    writes = "open('partial', 'w').write('x')\nprint('started', flush=True)\nimport time\n"
    async with service.client.stream(
        "POST", "/v1/exec", json=body(writes + "time.sleep(60)", hint="gone"), headers=NDJSON
    ) as response:
        assert "started" in await anext(response.aiter_lines())
    after = await _exec_until_free(service, "import os; print(sorted(os.listdir('.')))", "gone")
    assert after.stdout == "['kept', 'partial']\n"

    # The plain JSON answer: the client gives up once the job has written its file
    # (seen in the session workspace on this host) and while it sleeps.
    plain = asyncio.create_task(
        service.exec(
            code="open('plain', 'w').write('x')\nimport time\ntime.sleep(60)",
            runtime_session_hint="gone",
        )
    )
    for _ in range(1200):
        if any(service.runtime_dir.rglob("plain")):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the job never started")
    plain.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await plain
    after = await _exec_until_free(service, "import os; print(sorted(os.listdir('.')))", "gone")
    assert after.stdout == "['kept', 'partial', 'plain']\n"
    metrics = (await service.client.get("/metrics")).text
    assert "sandcell_interrupted_turns_total 2" in metrics, metrics
    for name in ("turn", "launch", "checkpoint"):
        assert f"# TYPE sandcell_{name}_duration_seconds histogram" in metrics
    assert 'sandcell_restore_duration_seconds_bucket{le="+Inf"} 0' in metrics
    turns = re.search(r"^sandcell_turn_duration_seconds_count (\d+)$", metrics, re.MULTILINE)
    assert turns is not None
    assert int(turns.group(1)) >= 5  # and the 409s _exec_until_free met


def test_events_are_protocol_stream_events() -> None:
    """The stream's lines are the protocol's StreamEvent union (what runners stream too)."""
    line = msgspec.json.encode({"type": "stdout", "data": "x"})
    assert decode_event(line) == StdoutEvent(data="x")
