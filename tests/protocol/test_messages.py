"""Every message round-trips; decoding is strict and fails with ProtocolError."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from sandcell_protocol import (
    CheckpointMeta,
    EgressOmittedEvent,
    EgressRefusedEvent,
    ErrorBody,
    ErrorCode,
    ErrorDetail,
    ExecCall,
    ExecuteRequest,
    ExecuteResult,
    FileEntry,
    FileListing,
    FileRef,
    Health,
    HealthSummary,
    InlineFile,
    InputManifest,
    InputObject,
    InputProbe,
    InputProbeResult,
    InputUploadResult,
    Language,
    Languages,
    Limits,
    OutputFile,
    PrimedInput,
    ProtocolError,
    RestoreResult,
    ResultEvent,
    RunnerLimits,
    RunStatus,
    StderrEvent,
    StdoutEvent,
    SurfacedOutput,
    decode,
    decode_event,
    encode,
    encode_event,
    error_body,
)
from sandcell_protocol.egress import EgressReason
from sandcell_protocol.messages import ALL_MESSAGES

REF = FileRef(storage_session="s", object_id="o", name="data/in.csv", read_only=True)
RESULT = ExecuteResult(
    status=RunStatus.OK,
    exit_code=0,
    signal=None,
    stdout="hi\n",
    stderr="",
    stdout_truncated=False,
    stderr_truncated=False,
    wall_ms=12,
    cpu_ms=3,
    max_rss_kib=9000,
    files=[OutputFile(name="out.txt", size=2, sha256="a" * 64, content_b64="aGk=")],
    session_id=None,
)
SAMPLES: list[Any] = [
    REF,
    InlineFile(name="main.py", content_b64="cHJpbnQoMSk=", executable=True),
    Limits(memory_mib=256, pids=64),
    ExecuteRequest(
        language="python",
        code="print(1)",
        args=["a"],
        stdin="x",
        env={"K": "V"},
        timeout_ms=500,
        files=[REF],
        inline_files=[InlineFile(name="a.txt", content_b64="")],
        limits=Limits(stdout_bytes=10),
    ),
    RESULT,
    StdoutEvent(data="a"),
    StderrEvent(data="b"),
    ResultEvent(result=RESULT),
    EgressRefusedEvent(reason=EgressReason.NOT_ALLOWED, transport="tls", name="x.test", port=443),
    EgressOmittedEvent(count=2),
    Health(status="ok", protocol="1.0", runner_version="0.1.0", languages=["python"]),
    HealthSummary(status="ok", protocol="1.0"),
    RunnerLimits(
        timeout_ms=30_000,
        max_timeout_ms=600_000,
        stdout_bytes=1 << 20,
        max_stdout_bytes=64 << 20,
        stderr_bytes=1 << 20,
        max_stderr_bytes=64 << 20,
        max_body_bytes=64 << 20,
        output_inline_bytes=1 << 20,
        max_output_files=1000,
        output_scan_bytes=256 << 20,
        checkpoint_max_bytes=1 << 30,
        input_max_object_bytes=1 << 30,
    ),
    InputProbe(refs=[REF]),
    InputProbeResult(missing=[]),
    InputManifest(objects={"b" * 64: InputObject(size=3, sha256="c" * 64)}),
    CheckpointMeta(session_id="rt_" + "0" * 64, protocol="1.0"),
    error_body(ErrorCode.SESSION_BUSY, "busy"),
    ErrorDetail(code=ErrorCode.INTERNAL, message="x", retryable=False),
    InputObject(size=0, sha256="d" * 64, read_only=True),
    OutputFile(name="o", size=0, sha256="e" * 64),
    Language(name="python", version="3.11.2"),
    Languages(languages=[Language(name="bash", version="5.2")]),
    InputUploadResult(stored=["f" * 64]),
    FileEntry(name="a", kind="file", size=1, mtime_ns=2, mode=0o644),
    FileListing(
        path="",
        entries=[
            FileEntry(name="l", kind="symlink", size=3, mtime_ns=0, mode=0o777, symlink_target="x")
        ],
    ),
    RestoreResult(session_id="rt_" + "2" * 64, files=3, bytes=10),
    PrimedInput(storage_session="s", object_id="o", name="n", read_only=False, sha256="a" * 64),
    SurfacedOutput(name="n", size=1, mtime_ns=2, sha256="b" * 64),
    CheckpointMeta(
        session_id="rt_" + "1" * 64,
        protocol="1.0",
        primed_inputs=[
            PrimedInput(
                storage_session="s", object_id="o", name="n", read_only=True, sha256="a" * 64
            )
        ],
        surfaced_outputs=[SurfacedOutput(name="n", size=1, mtime_ns=2, sha256="b" * 64)],
        skipped=["fifo"],
    ),
    ExecCall(language="python", code="1", user_id="u", runtime_session_hint="chat-1"),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Any) -> None:
    assert decode(encode(message), type(message)) == message


def test_every_message_has_a_sample() -> None:
    assert set(ALL_MESSAGES) == {type(m) for m in SAMPLES}


def test_defaults_match_contract() -> None:
    request = decode(b'{"language":"python","code":"1"}', ExecuteRequest)
    assert request.args == []
    assert request.stdin is None
    assert request.env == {}
    assert request.timeout_ms == 30000
    assert request.files == []
    assert request.inline_files == []
    assert request.limits is None
    assert decode(b'{"storage_session":"s","object_id":"o","name":"n"}', FileRef).read_only is False


def test_error_body_shape() -> None:
    body = json.loads(encode(error_body(ErrorCode.INVALID_PATH, "bad")))
    assert body == {"error": {"code": "invalid_path", "message": "bad", "retryable": False}}


def test_stream_events_tagged() -> None:
    line = encode_event(StdoutEvent(data="x"))
    assert line.endswith(b"\n")
    assert json.loads(line) == {"type": "stdout", "data": "x"}
    assert decode_event(line) == StdoutEvent(data="x")
    assert isinstance(decode_event(encode_event(ResultEvent(result=RESULT))), ResultEvent)
    with pytest.raises(ProtocolError):
        decode_event(b'{"type":"stdin","data":"x"}')


@pytest.mark.parametrize(
    ("payload", "type_", "field"),
    [
        (b'{"language":"python","code":"1","bogus":1}', ExecuteRequest, "bogus"),
        (b'{"language":"python"}', ExecuteRequest, "code"),
        (b'{"language":"python","code":1}', ExecuteRequest, "code"),
        (b'{"language":"python","code":"1","timeout_ms":"5"}', ExecuteRequest, "timeout_ms"),
        (b'{"language":"python","code":"1","timeout_ms":0}', ExecuteRequest, "timeout_ms"),
        (b'{"language":"python","code":"1","limits":{"pids":-1}}', ExecuteRequest, "pids"),
        (b'{"error":{"code":"teapot","message":"x","retryable":false}}', ErrorBody, "code"),
        (
            b'{"status":"exploded","exit_code":0,"signal":null,"stdout":"","stderr":"",'
            b'"stdout_truncated":false,"stderr_truncated":false,"wall_ms":1,"cpu_ms":1,'
            b'"max_rss_kib":null,"files":[]}',
            ExecuteResult,
            "status",
        ),
        (
            b'{"status":"ok","protocol":"1.0","runner_version":"x","warmup":"maybe"}',
            Health,
            "warmup",
        ),
        (
            b'{"language":"python","code":"1","user_id":"u","runtime_session_hint":"'
            + b"h" * 129
            + b'"}',
            ExecCall,
            "runtime_session_hint",
        ),
        (
            b'{"language":"python","code":"1","user_id":"u","runtime_session_hint":"a b"}',
            ExecCall,
            "runtime_session_hint",
        ),
        (b"{not json", ExecuteRequest, "malformed"),
        (
            b'{"language":"python","code":"1","user_id":"u","runtime_session_hint":"ab\\n"}',
            ExecCall,
            "runtime_session_hint",
        ),
        (
            b'{"objects":{"' + b"a" * 64 + b'\\n":{"size":1,"sha256":"' + b"a" * 64 + b'"}}}',
            InputManifest,
            "objects",
        ),
    ],
)
def test_decode_rejects(payload: bytes, type_: type[Any], field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        decode(payload, type_)


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        REF.name = "other"  # type: ignore[misc]


def test_encode_rejects_unencodable() -> None:
    with pytest.raises(ProtocolError):
        encode(object())


def test_schema_export_covers_every_message() -> None:
    from sandcell_protocol.schema import json_schema

    components = json_schema()["components"]
    for message in ALL_MESSAGES:
        assert message.__name__ in components
    assert msgspec.json.decode(msgspec.json.encode(components))


def test_decoding_into_a_union_fails_with_protocol_error() -> None:
    """A union has no ``__name__``: bad input is still a ProtocolError, not an AttributeError."""
    with pytest.raises(ProtocolError, match="StdoutEvent"):
        decode(b'{"type": "nope"}', StdoutEvent | StderrEvent)
    with pytest.raises(ProtocolError, match="malformed JSON"):
        decode(b"{", StdoutEvent | StderrEvent)


def test_health_limits_are_absent_unless_stated() -> None:
    """``Health.limits`` (1.3) is left out of the JSON when unset, so a 1.2 peer's strict
    decoding still reads the answer; a 1.2 runner's ``Health`` (no key) decodes unset."""
    older = Health(status="ok", protocol="1.3", runner_version="0.1.0")
    assert b"limits" not in encode(older)
    assert decode(b'{"status":"ok","protocol":"1.2","runner_version":"0"}', Health).limits is (
        msgspec.UNSET
    )
    limits = next(m for m in SAMPLES if isinstance(m, RunnerLimits))
    stated = msgspec.structs.replace(older, limits=limits)
    assert decode(encode(stated), Health).limits == limits
