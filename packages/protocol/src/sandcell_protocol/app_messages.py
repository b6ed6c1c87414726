"""Wire shapes of a session's app features: background processes, logs, preview, diagnostics.

Frozen and strict like ``messages.py``. Route paths below extend ``routes.py``;
helpers build the per-tag and per-port paths so both peers spell them alike.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from .messages import (
    SEGMENT_NAME_PATTERN,
    SEGMENT_NAME_RULE,
    Limits,
    Message,
    NonEmptyStr,
    NonNegativeInt,
    PositiveInt,
)
from .routes import SESSION_PORTS_PREFIX, SESSION_PROCESSES

# A path segment of the runner's routes: see messages.SEGMENT_NAME_PATTERN.
PROCESS_TAG_PATTERN = SEGMENT_NAME_PATTERN
PROCESS_TAG_RULE = SEGMENT_NAME_RULE
"""``PROCESS_TAG_PATTERN`` as error messages show it."""
ProcessTag = Annotated[str, msgspec.Meta(pattern=PROCESS_TAG_PATTERN)]

FORWARDED_PREFIX_HEADER = "X-Forwarded-Prefix"
"""Set by a proxy in front of ``/v1/session/ports/{port}/``: the path prefix the browser
sees (``/preview/<id>/``), so the injected reporter posts back through that proxy."""

BROWSER_ERRORS_PATH = "__sandcell/runtime-errors"
"""Relative to a port's prefix: where the injected script POSTs a ``RuntimeErrorReport``."""
PREVIEW_CHANGES_PATH = "__sandcell/changes"
"""Relative to a port's prefix: ``GET`` answers ``{"version": n}``, which grows with every
file written or removed through the session's file routes (the live-reload channel)."""
LIVE_RELOAD_HEADER = "X-Sandcell-Live-Reload"
"""Set to ``0`` by a proxy whose app reloads its pages itself: no reload script is injected."""

SESSION_PROCESS = SESSION_PROCESSES + "/{tag}"
SESSION_PROCESS_LOGS = SESSION_PROCESSES + "/{tag}/logs"
SESSION_PROCESS_STDIN = SESSION_PROCESSES + "/{tag}/stdin"
SESSION_PORTS = SESSION_PORTS_PREFIX + "{port:int}/{path:path}"

_TAG_RE = re.compile(PROCESS_TAG_PATTERN)


def is_process_tag(value: str) -> bool:
    """Whether ``value`` is a valid process tag (``PROCESS_TAG_RULE``)."""
    return bool(_TAG_RE.match(value))


def process_path(tag: str, suffix: Literal["", "logs", "stdin"] = "") -> str:
    """``/v1/session/processes/{tag}[/logs|/stdin]`` for a valid tag."""
    if not is_process_tag(tag):
        raise ValueError(f"invalid process tag {tag[:80]!r}")
    base = f"{SESSION_PROCESSES}/{tag}"
    return f"{base}/{suffix}" if suffix else base


def port_path(port: int, path: str = "") -> str:
    """``/v1/session/ports/{port}/{path}`` (``path`` without a leading slash)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be 1..65535, got {port}")
    return f"{SESSION_PORTS_PREFIX}{port}/{path.lstrip('/')}"


# -- processes ------------------------------------------------------------------


class ProcessStart(Message, frozen=True, kw_only=True):
    """``POST /v1/session/processes``: run ``bash -lc command`` in the background.

    ``cwd`` is a workspace path (default: the workspace root). ``timeout_ms`` of
    None means no wall time: the process runs until it exits or is stopped.
    """

    tag: ProcessTag
    command: NonEmptyStr
    env: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str | None = None
    timeout_ms: PositiveInt | None = None
    limits: Limits | None = None


ProcessState = Literal["running", "exited"]


class ProcessInfo(Message, frozen=True, kw_only=True):
    """One background process; an exited one keeps its status until replaced.

    ``exit_code`` is set when it exited by itself, ``signal`` (``SIGTERM``…) when
    a signal ended it. ``pid`` is the host pid of the process's jail while it
    runs (inside the jail the command has its own pid namespace). Times are
    epoch seconds.
    """

    tag: str
    pid: int | None = None
    state: ProcessState
    exit_code: int | None = None
    signal: str | None = None
    started_at_s: float
    ended_at_s: float | None = None


class ProcessList(Message, frozen=True, kw_only=True):
    """``GET /v1/session/processes``."""

    processes: list[ProcessInfo]


class LogLines(Message, frozen=True, kw_only=True):
    """``GET …/processes/{tag}/logs``: the last lines of merged stdout and stderr.

    ``truncated`` is True when older lines the request would have reached were
    already dropped from the bounded buffer, or a returned line was cut short.
    """

    tag: str
    lines: list[str]
    truncated: bool


class LogLine(Message, frozen=True, kw_only=True):
    """One NDJSON line of ``…/logs?follow=1``; the stream ends when the process exits."""

    line: str


# -- runtime errors ----------------------------------------------------------------

ErrorCategory = Literal["syntax", "reference", "type", "network", "other"]


class RuntimeErrorReport(Message, frozen=True, kw_only=True):
    """What the injected browser script POSTs (the body is untrusted: lengths capped)."""

    type: Annotated[str, msgspec.Meta(max_length=200)]
    message: Annotated[str, msgspec.Meta(max_length=16_384)]
    stack: Annotated[str, msgspec.Meta(max_length=65_536)] | None = None
    url: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    line: NonNegativeInt | None = None
    column: NonNegativeInt | None = None


class RuntimeErrorRecord(Message, frozen=True, kw_only=True):
    """One deduplicated runtime error (same fingerprint: counted, not repeated).

    ``source`` is ``browser`` or ``process:<tag>``; times are epoch seconds.
    """

    fingerprint: str
    type: str
    category: ErrorCategory
    message: str
    file: str | None = None
    line: int | None = None
    column: int | None = None
    top_frame: str | None = None
    source: str
    count: PositiveInt
    first_seen_s: float
    last_seen_s: float


class RuntimeErrors(Message, frozen=True, kw_only=True):
    """``GET /v1/session/runtime-errors[?since=<epoch s>]``: errors last seen at/after ``since``."""

    errors: list[RuntimeErrorRecord]


# -- static analysis ------------------------------------------------------------------

Severity = Literal["error", "warning", "info"]


class Diagnostic(Message, frozen=True, kw_only=True):
    """One finding of a checker; ``file`` is workspace-relative, line and column 1-based
    (0 when the checker names no position)."""

    file: str
    line: NonNegativeInt
    column: NonNegativeInt
    severity: Severity
    code: str | None = None
    message: str
    tool: str


class ToolStatus(Message, frozen=True, kw_only=True):
    """Whether a checker ran; an unavailable one found nothing because it did not run."""

    tool: str
    available: bool
    detail: str | None = None


class AnalysisResult(Message, frozen=True, kw_only=True):
    """``GET /v1/session/analysis``."""

    diagnostics: list[Diagnostic]
    tools: list[ToolStatus]


APP_MESSAGES: tuple[type[Message], ...] = (
    ProcessStart,
    ProcessInfo,
    ProcessList,
    LogLines,
    LogLine,
    RuntimeErrorReport,
    RuntimeErrorRecord,
    RuntimeErrors,
    Diagnostic,
    ToolStatus,
    AnalysisResult,
)
