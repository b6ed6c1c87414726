"""Pure pieces of the app features, without a runner: messages, parsing, fingerprints."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from sandcell_protocol import ProtocolError, decode, encode
from sandcell_protocol import app_messages as am
from sandcell_runner.apps.logbuffer import CUT_MARK, FELL_BEHIND, LineBuffer
from sandcell_runner.apps.procinit import parse_report
from sandcell_runner.apps.runtime_errors import (
    ErrorEvent,
    RuntimeErrorStore,
    categorize,
    fingerprint,
    from_browser,
    normalize,
)
from sandcell_runner.apps.tracescan import TraceScanner
from sandcell_runner.errors import BusyError
from sandcell_runner.preview.inject import inject, reporter_prefix, reporter_tag
from sandcell_runner.preview.relays import PreviewRelays

SAMPLES: list[Any] = [
    am.ProcessStart(tag="web", command="npm run dev", env={"A": "1"}, cwd="app", timeout_ms=5),
    am.ProcessInfo(tag="web", pid=3, state="running", started_at_s=1.5),
    am.ProcessList(
        processes=[am.ProcessInfo(tag="a", state="exited", exit_code=1, started_at_s=1)]
    ),
    am.LogLines(tag="web", lines=["a"], truncated=False),
    am.LogLine(line="x"),
    am.RuntimeErrorReport(type="TypeError", message="m", stack="s", url="u", line=1, column=2),
    am.RuntimeErrorRecord(
        fingerprint="f",
        type="T",
        category="type",
        message="m",
        source="browser",
        count=1,
        first_seen_s=1,
        last_seen_s=2,
    ),
    am.RuntimeErrors(errors=[]),
    am.Diagnostic(file="a.py", line=1, column=2, severity="error", message="m", tool="ruff"),
    am.ToolStatus(tool="tsc", available=False, detail="no tsconfig.json"),
    am.AnalysisResult(diagnostics=[], tools=[]),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_app_messages_round_trip(message: Any) -> None:
    assert decode(encode(message), type(message)) == message


def test_every_app_message_has_a_sample_and_a_schema() -> None:
    assert set(am.APP_MESSAGES) == {type(m) for m in SAMPLES}
    _, components = msgspec.json.schema_components(am.APP_MESSAGES)
    assert {m.__name__ for m in am.APP_MESSAGES} <= set(components)


@pytest.mark.parametrize(
    ("body", "type_"),
    [
        (b'{"tag":"a b","command":"x"}', am.ProcessStart),
        (b'{"tag":"' + b"a" * 65 + b'","command":"x"}', am.ProcessStart),
        (b'{"tag":"ok","command":""}', am.ProcessStart),
        (b'{"tag":"ok","command":"x","extra":1}', am.ProcessStart),
        (b'{"tag":"ok\\n","command":"x"}', am.ProcessStart),
        (b'{"type":"E","message":"' + b"m" * 20000 + b'"}', am.RuntimeErrorReport),
        (b'{"tag":"a","state":"sleeping","started_at_s":1}', am.ProcessInfo),
    ],
)
def test_app_messages_are_strict(body: bytes, type_: type[Any]) -> None:
    with pytest.raises(ProtocolError):
        decode(body, type_)


def test_path_helpers() -> None:
    assert am.process_path("web") == "/v1/session/processes/web"
    assert am.process_path("web", "logs") == "/v1/session/processes/web/logs"
    assert am.port_path(5173, "/src/main.ts") == "/v1/session/ports/5173/src/main.ts"
    for bad in ("../x", ".", "..", "-x"):
        with pytest.raises(ValueError, match="tag"):
            am.process_path(bad)
        assert not am.is_process_tag(bad)
    with pytest.raises(ValueError, match="port"):
        am.port_path(0)


def test_normalize_strips_what_varies() -> None:
    a = "timeout after 1532 ms at 2024-05-01T10:00:00Z (0x7f3a2b) in '/tmp/run-81/app.py'"
    b = "timeout after 17 ms at 2025-01-01 09:09:09.123 (0xdeadbeef) in '/var/x/app.py'"
    assert normalize(a) == normalize(b)
    # A quoted name is the error's subject, not noise.
    assert normalize("name 'foo' is not defined") != normalize("name 'bar' is not defined")
    first = ErrorEvent(type="E", message="m", source="s", top_frame="at f (/a/x.js?t=1:10:2)")
    moved = ErrorEvent(type="E", message="m", source="s", top_frame="at f (/a/x.js?t=9:12:2)")
    assert fingerprint(first) == fingerprint(moved)


@pytest.mark.parametrize(
    ("type_", "message", "category"),
    [
        ("SyntaxError", "invalid syntax", "syntax"),
        ("IndentationError", "unexpected indent", "syntax"),
        ("NameError", "name 'x' is not defined", "reference"),
        ("ReferenceError", "x is not defined", "reference"),
        ("AttributeError", "'NoneType' object has no attribute 'x'", "type"),
        ("TypeError", "Failed to fetch", "network"),
        ("TypeError", "fetch failed", "network"),
        ("Error", "connect ECONNREFUSED 127.0.0.1:5432", "network"),
        ("requests.exceptions.ConnectionError", "boom", "network"),
        ("ValueError", "bad", "other"),
    ],
)
def test_categories(type_: str, message: str, category: str) -> None:
    assert categorize(type_, message) == category


def test_store_is_bounded_and_counts() -> None:
    now = [100.0]
    store = RuntimeErrorStore(max_fingerprints=3, clock=lambda: now[0])
    for i in range(5):
        now[0] += 1
        record, new = store.record(ErrorEvent(type=f"E{i}", message="m", source="s"))
        assert new
    now[0] += 1
    record, new = store.record(ErrorEvent(type="E4", message="m", source="s"))
    assert not new
    assert record.count == 2
    assert (record.first_seen_s, record.last_seen_s) == (105.0, 106.0)
    assert [r.type for r in store.since()] == ["E2", "E3", "E4"]
    assert [r.type for r in store.since(105.5)] == ["E4"]


def _scan(text: str) -> list[ErrorEvent]:
    found: list[ErrorEvent] = []
    scanner = TraceScanner("process:t", found.append)
    for line in text.splitlines():
        scanner.feed(line)
    return found


def test_scanner_python_traceback_prefers_workspace_frames() -> None:
    (event,) = _scan(
        "GET / 500\n"
        "Traceback (most recent call last):\n"
        '  File "/mnt/data/app.py", line 9, in handler\n'
        "    json.loads(body)\n"
        '  File "/usr/lib/python3.11/json/__init__.py", line 346, in loads\n'
        "    return _default_decoder.decode(s)\n"
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n"
        "next request\n"
    )
    assert event.type == "json.decoder.JSONDecodeError"
    assert event.message == "Expecting value: line 1 column 1 (char 0)"
    assert (event.file, event.line) == ("app.py", 9)
    assert event.top_frame == ('File "/usr/lib/python3.11/json/__init__.py", line 346, in loads')


def test_scanner_node_trace_needs_a_frame() -> None:
    events = _scan(
        "Error: just a log line mentioning Error\n"
        "listening\n"
        "/mnt/data/server.js:5\n"
        "    foo();\n"
        "    ^\n"
        "\n"
        "TypeError: foo is not a function\n"
        "    at Server.<anonymous> (/mnt/data/server.js:5:5)\n"
        "    at Server.emit (node:events:517:28)\n"
        "Error [ERR_MODULE_NOT_FOUND]: Cannot find package 'left-pad'\n"
        "    at packageResolve (node:internal/modules/esm/resolve:844:9)\n"
    )
    assert [(e.type, e.message) for e in events] == [
        ("TypeError", "foo is not a function"),
        ("Error", "Cannot find package 'left-pad'"),
    ]
    assert (events[0].file, events[0].line, events[0].column) == ("server.js", 5, 5)
    assert events[0].top_frame == "at Server.<anonymous> (server.js:5:5)"


def test_browser_report_takes_position_from_the_stack() -> None:
    event = from_browser(
        am.RuntimeErrorReport(
            type="TypeError",
            message="x is undefined",
            stack="TypeError: x is undefined\n    at render (http://h/p/src/App.tsx?t=5:40:11)",
            url="http://h/p/",
        )
    )
    assert (event.file, event.line, event.column) == ("/p/src/App.tsx", 40, 11)
    firefox = from_browser(
        am.RuntimeErrorReport(type="Error", message="m", stack="render@http://h/a.js:3:9\n")
    )
    assert (firefox.file, firefox.line, firefox.column) == ("/a.js", 3, 9)


def test_injection_places_and_escapes() -> None:
    tag = reporter_tag("/preview/x/")
    assert inject(b"<html><head></head><body></body></html>", tag).index(tag) == 12
    assert inject(b"<html><BODY class=a>hi</BODY></html>", tag).startswith(b"<html><BODY class=a>")
    assert inject(b"just text", tag) == tag + b"just text"
    assert reporter_prefix("/p/", 1) == "/p/"
    for hostile in ("/p", "p/", "/a b/", '/"x/', "/x/</script>/", "/" + "a" * 600 + "/"):
        assert reporter_prefix(hostile, 3000) == "/v1/session/ports/3000/"
    assert b"</script" not in reporter_tag("/x/")[8:-9]


def test_init_report_parsing() -> None:
    assert parse_report("exit 3\n") == (3, None)
    assert parse_report("signal 15\n") == (None, 15)
    assert parse_report("") is None
    assert parse_report("garbage") is None


def test_line_buffer_cuts_and_follows() -> None:
    async def scenario() -> None:
        seen: list[str] = []
        buffer = LineBuffer(max_lines=3, max_line_chars=5, max_backlog=2, on_line=seen.append)
        follower = buffer.follow()
        buffer.feed(b"ab\r\ncdefghij")
        buffer.feed(b"klm\nn\xc3")
        buffer.feed(b"\xa9\n")
        assert seen == ["ab", "cdefg" + CUT_MARK, "n\u00e9"]
        tail = buffer.snapshot().tail(10)
        assert tail.truncated  # the cut line is returned
        lines = [line async for line in follower.lines()]
        assert lines == ["ab", "cdefg" + CUT_MARK, FELL_BEHIND]
        buffer.feed(b"o\np\nq")
        buffer.close()
        snapshot = buffer.snapshot()
        assert snapshot.texts == ["o", "p", "q"]
        assert snapshot.tail(2).lines == ["p", "q"]
        assert not snapshot.tail(2).truncated
        assert snapshot.tail(5).truncated  # asked past what the ring still holds
        assert snapshot.tail(2, [True, False, True]).lines == ["o", "q"]
        assert [line async for line in buffer.follow().lines()] == []

    asyncio.run(scenario())


def test_relay_slots_are_refused_past_the_cap_and_given_back_once() -> None:
    relays = PreviewRelays.create(max_websockets=2, max_requests=1)
    first, second = (relays.websockets.claim("rt_a") for _ in range(2))
    with pytest.raises(BusyError, match="SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS=2"):
        relays.websockets.claim("rt_a")
    relays.requests.claim("rt_a")  # a cap of its own
    first.release()
    first.release()  # idempotent: never frees a place twice
    assert relays.websockets.active == 1
    relays.websockets.claim("rt_a")
    assert relays.websockets.active == 2
    second.release()
    assert relays.websockets.active == 1


def test_releasing_a_session_aborts_its_relays_and_frees_their_slots() -> None:
    relays = PreviewRelays.create(max_websockets=3, max_requests=3)
    aborted: list[str] = []
    mine = relays.websockets.claim("rt_a")
    mine.on_abort(lambda: aborted.append("a"))
    other = relays.websockets.claim("rt_b")
    other.on_abort(lambda: aborted.append("b"))
    relays.requests.claim("rt_a")
    relays.abort_session("rt_a")
    assert aborted == ["a"]
    assert (relays.websockets.active, relays.requests.active) == (1, 0)
    mine.release()  # the relay's own release, after the abort ended it: a no-op
    assert relays.websockets.active == 1
