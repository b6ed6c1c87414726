"""Context messages: golden wire vectors, strict decoding, schema export, paths."""

from __future__ import annotations

from typing import Any

import pytest

from sandcell_protocol import ERROR_SEMANTICS, ErrorCode, Language, ProtocolError, decode, encode
from sandcell_protocol import contexts as cx
from sandcell_protocol.schema import json_schema
from tests.golden import load_golden

GOLDEN = load_golden()

SAMPLES: list[Any] = [
    cx.ContextCreate(language="python", cwd="sub", env={"A": "1"}, context_id="nb"),
    cx.ContextInfo(context_id="nb", language="python", state="lost", lost_reason="killed"),
    cx.ContextList(contexts=[cx.ContextInfo(context_id="nb", language="python")]),
    cx.ContextRun(code="x = 1", timeout_ms=500, env={"B": "2"}),
    cx.ContextStdoutEvent(data="out"),
    cx.ContextStderrEvent(data="err"),
    cx.ContextResultEvent(
        data={"text/plain": "1", "image/png": "iVBO", "application/json": {"k": [1]}},
        is_main_result=True,
    ),
    cx.ContextErrorEvent(name="ValueError", value="bad", traceback="Traceback ..."),
    cx.ContextEndEvent(
        status=cx.ContextStatus.MEMORY_LIMIT,
        execution_count=3,
        wall_ms=10,
        cpu_ms=5,
        context_lost=True,
    ),
    cx.ContextRunResult(status=cx.ContextStatus.OK, execution_count=1, wall_ms=1, cpu_ms=0),
    cx.RunCall(language="python", code="x", user_id="u", context_id="nb"),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Any) -> None:
    assert decode(encode(message), type(message)) == message


def test_every_context_message_has_a_sample_and_a_schema() -> None:
    assert set(cx.CONTEXT_MESSAGES) == {type(m) for m in SAMPLES}
    components = json_schema()["components"]
    for message in cx.CONTEXT_MESSAGES:
        assert message.__name__ in components


def test_golden_run_events_gather_into_the_golden_result() -> None:
    vector = GOLDEN["context_run"]
    events = [cx.decode_context_event(line) for line in vector["events"]]
    assert [encode(e).decode() for e in events] == vector["events"]
    assert encode(cx.gather_events(events)).decode() == vector["result"]
    assert decode(vector["result"], cx.ContextRunResult) == cx.gather_events(events)


@pytest.mark.parametrize("vector", GOLDEN["context_path"])
def test_context_path_golden(vector: dict[str, Any]) -> None:
    assert cx.context_path(vector["context_id"], vector["suffix"]) == vector["path"]


@pytest.mark.parametrize("context_id", GOLDEN["context_id_invalid"])
def test_invalid_context_ids_are_refused(context_id: str) -> None:
    assert not cx.is_context_id(context_id)
    with pytest.raises(ValueError, match="invalid context id"):
        cx.context_path(context_id)
    with pytest.raises(ProtocolError):
        decode(encode({"context_id": context_id}), cx.ContextCreate)


def test_decoding_is_strict() -> None:
    with pytest.raises(ProtocolError):
        decode(b'{"type":"result","data":{"text/x-unknown":"1"}}', cx.ContextResultEvent)
    with pytest.raises(ProtocolError):
        cx.decode_context_event(
            b'{"type":"end","status":"maybe","execution_count":1,"wall_ms":1,"cpu_ms":1}'
        )
    with pytest.raises(ProtocolError):
        cx.decode_context_event(b'{"type":"nope"}')
    with pytest.raises(ProtocolError):
        decode(b'{"code":"1","extra":true}', cx.ContextRun)


def test_gather_needs_an_end_event() -> None:
    with pytest.raises(ValueError, match="ContextEndEvent"):
        cx.gather_events([cx.ContextStdoutEvent(data="x")])


def test_context_lost_is_a_409_and_languages_say_contexts() -> None:
    semantics = ERROR_SEMANTICS[ErrorCode.CONTEXT_LOST]
    assert (semantics.http_status, semantics.retryable) == (409, False)
    assert decode(b'{"name":"python","version":"3"}', Language).contexts is False
