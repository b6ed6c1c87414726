"""Wire shapes of stateful code contexts: a long-lived interpreter per context.

A context lives inside the bound session's jail (``/v1/session/contexts``). A run
is streamed as NDJSON (``ContextEvent`` lines, ``ContextEndEvent`` last) when the
caller sends ``Accept: application/x-ndjson``; otherwise it is answered as one
``ContextRunResult`` with the same content. Frozen and strict like ``messages.py``.
"""

from __future__ import annotations

import enum
import re
import typing
from typing import Annotated, Any, Literal

import msgspec

from .errors import ProtocolError
from .messages import (
    SEGMENT_NAME_PATTERN,
    SEGMENT_NAME_RULE,
    ExecCall,
    Message,
    NonEmptyStr,
    NonNegativeInt,
    OutputFile,
    PositiveInt,
)

SESSION_CONTEXTS = "/v1/session/contexts"
SESSION_CONTEXT = SESSION_CONTEXTS + "/{context_id}"
SESSION_CONTEXT_RUN = SESSION_CONTEXT + "/run"
SESSION_CONTEXT_RESTART = SESSION_CONTEXT + "/restart"
SESSION_CONTEXT_INTERRUPT = SESSION_CONTEXT + "/interrupt"

# A path segment of the runner's and serve's routes: see messages.SEGMENT_NAME_PATTERN.
CONTEXT_ID_PATTERN = SEGMENT_NAME_PATTERN
CONTEXT_ID_RULE = SEGMENT_NAME_RULE
"""``CONTEXT_ID_PATTERN`` as error messages show it."""
ContextId = Annotated[str, msgspec.Meta(pattern=CONTEXT_ID_PATTERN)]
_CONTEXT_ID_RE = re.compile(CONTEXT_ID_PATTERN)

MimeType = Literal[
    "text/plain",
    "text/html",
    "text/markdown",
    "text/latex",
    "image/png",
    "image/jpeg",
    "image/svg+xml",
    "application/json",
    "application/javascript",
]
"""MIME types a result may carry. Binary images are base64; ``application/json`` is a
JSON value; the others are text."""
MIME_TYPES: tuple[str, ...] = typing.get_args(MimeType)


def is_context_id(value: str) -> bool:
    """Whether ``value`` is a valid context id (``CONTEXT_ID_RULE``): the one check of an id
    wherever one enters (runner, orchestrator, serve, the E2B interpreter)."""
    return bool(_CONTEXT_ID_RE.match(value))


def context_path(context_id: str, suffix: Literal["", "run", "restart", "interrupt"] = "") -> str:
    """``/v1/session/contexts/{id}[/run|/restart|/interrupt]`` for a valid id."""
    if not is_context_id(context_id):
        raise ValueError(f"invalid context id {context_id[:80]!r}")
    base = f"{SESSION_CONTEXTS}/{context_id}"
    return f"{base}/{suffix}" if suffix else base


ContextState = Literal["idle", "busy", "lost"]


class ContextCreate(Message, frozen=True):
    """``POST /v1/session/contexts``: start an interpreter for ``language``.

    ``cwd`` is a workspace path (default: the workspace root). ``context_id`` lets
    the caller name the context (default: the runner picks one).
    """

    language: NonEmptyStr = "python"
    cwd: str | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)
    context_id: ContextId | None = None


class ContextInfo(Message, frozen=True):
    """One context. ``lost``: its interpreter is gone (``lost_reason`` says why); a run
    answers ``context_lost`` until it is restarted or deleted."""

    context_id: str
    language: str
    state: ContextState = "idle"
    cwd: str = ""
    execution_count: NonNegativeInt = 0
    lost_reason: str | None = None


class ContextList(Message, frozen=True):
    """``GET /v1/session/contexts``."""

    contexts: list[ContextInfo]


class ContextRun(Message, frozen=True):
    """``POST /v1/session/contexts/{id}/run``: run ``code`` in the context.

    ``env`` applies to this run only. ``timeout_ms``: default and cap are the
    runner's; past it the run is interrupted (SIGINT), then killed after a grace.
    """

    code: str
    timeout_ms: PositiveInt | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)


class ContextStatus(enum.StrEnum):
    """How a run ended."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    CONTEXT_LOST = "context_lost"


class ContextStdoutEvent(Message, frozen=True, tag_field="type", tag="stdout"):
    """Output the code printed, as it happens."""

    data: str


class ContextStderrEvent(Message, frozen=True, tag_field="type", tag="stderr"):
    """Error output of the code, as it happens."""

    data: str


class ContextResultEvent(Message, frozen=True, tag_field="type", tag="result"):
    """A displayed value by MIME type; ``is_main_result`` for the last expression's."""

    data: dict[MimeType, Any]
    is_main_result: bool = False


class ContextErrorEvent(Message, frozen=True, tag_field="type", tag="error"):
    """An exception the code raised (the context keeps its variables)."""

    name: str
    value: str
    traceback: str


class ContextEndEvent(Message, frozen=True, tag_field="type", tag="end"):
    """The last event of a run. ``context_lost``: the interpreter is gone (timeout past
    the grace, memory kill, crash); later runs answer the ``context_lost`` error."""

    status: ContextStatus
    execution_count: NonNegativeInt
    wall_ms: NonNegativeInt
    cpu_ms: NonNegativeInt
    context_lost: bool = False
    message: str | None = None
    files: list[OutputFile] = msgspec.field(default_factory=list)
    """Workspace files the run created or changed (as ``ExecuteResult.files``)."""
    workspace_changed: bool | None = None
    """Whether the run added, changed or removed a workspace file (None: not tracked)."""


ContextEvent = (
    ContextStdoutEvent
    | ContextStderrEvent
    | ContextResultEvent
    | ContextErrorEvent
    | ContextEndEvent
)


class ContextRunResult(Message, frozen=True):
    """A run answered as one JSON object: the stream's content, gathered."""

    status: ContextStatus
    execution_count: NonNegativeInt
    wall_ms: NonNegativeInt
    cpu_ms: NonNegativeInt
    stdout: str = ""
    stderr: str = ""
    results: list[ContextResultEvent] = msgspec.field(default_factory=list)
    error: ContextErrorEvent | None = None
    context_lost: bool = False
    message: str | None = None
    files: list[OutputFile] = msgspec.field(default_factory=list)
    workspace_changed: bool | None = None


class RunCall(ExecCall, frozen=True, kw_only=True):
    """``POST /v1/run`` of the orchestrator's service: ``/v1/exec``'s body, run in a code
    context of the session (``context_id``; default: the language's default context).
    ``args``, ``stdin`` and ``limits`` do not apply to a context and are refused."""

    context_id: ContextId | None = None


_event_decoder = msgspec.json.Decoder(ContextEvent)


def decode_context_event(line: bytes | str) -> ContextEvent:
    """One NDJSON line of a context run (``ProtocolError`` if invalid)."""
    try:
        return _event_decoder.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"ContextEvent: {exc}") from exc


def gather_events(events: list[ContextEvent]) -> ContextRunResult:
    """The one-object answer of a stream of events (it must end with ``ContextEndEvent``)."""
    stdout: list[str] = []
    stderr: list[str] = []
    results: list[ContextResultEvent] = []
    error: ContextErrorEvent | None = None
    end: ContextEndEvent | None = None
    for event in events:
        if isinstance(event, ContextStdoutEvent):
            stdout.append(event.data)
        elif isinstance(event, ContextStderrEvent):
            stderr.append(event.data)
        elif isinstance(event, ContextResultEvent):
            results.append(event)
        elif isinstance(event, ContextErrorEvent):
            error = event
        else:
            end = event
    if end is None:
        raise ValueError("a context run's events end with a ContextEndEvent")
    return ContextRunResult(
        status=end.status,
        execution_count=end.execution_count,
        wall_ms=end.wall_ms,
        cpu_ms=end.cpu_ms,
        stdout="".join(stdout),
        stderr="".join(stderr),
        results=results,
        error=error,
        context_lost=end.context_lost,
        message=end.message,
        files=end.files,
        workspace_changed=end.workspace_changed,
    )


CONTEXT_MESSAGES: tuple[type[Message], ...] = (
    ContextCreate,
    ContextInfo,
    ContextList,
    ContextRun,
    ContextStdoutEvent,
    ContextStderrEvent,
    ContextResultEvent,
    ContextErrorEvent,
    ContextEndEvent,
    ContextRunResult,
    RunCall,
)

__all__ = [
    "CONTEXT_ID_PATTERN",
    "CONTEXT_ID_RULE",
    "CONTEXT_MESSAGES",
    "MIME_TYPES",
    "SESSION_CONTEXT",
    "SESSION_CONTEXTS",
    "SESSION_CONTEXT_INTERRUPT",
    "SESSION_CONTEXT_RESTART",
    "SESSION_CONTEXT_RUN",
    "ContextCreate",
    "ContextEndEvent",
    "ContextErrorEvent",
    "ContextEvent",
    "ContextId",
    "ContextInfo",
    "ContextList",
    "ContextResultEvent",
    "ContextRun",
    "ContextRunResult",
    "ContextState",
    "ContextStatus",
    "ContextStderrEvent",
    "ContextStdoutEvent",
    "MimeType",
    "RunCall",
    "context_path",
    "decode_context_event",
    "gather_events",
    "is_context_id",
]
