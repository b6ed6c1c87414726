"""The runner's app-route messages, as the orchestrator reads and sends them.

These mirror the contract of the runner's process, diagnostics and port routes
until ``sandcell_protocol.app_messages`` carries them; then this module only
re-exports them from there (DESIGN rule 1: one contract).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from sandcell_protocol import Limits

__all__ = [
    "AnalysisResult",
    "Diagnostic",
    "LogLines",
    "ProcessInfo",
    "ProcessList",
    "ProcessStart",
    "RuntimeErrorRecord",
    "RuntimeErrors",
    "ToolStatus",
]

ProcessTag = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ProcessStart(_Message, frozen=True):
    """Start ``command`` (``bash -c``) in the session workspace as a tagged process."""

    tag: ProcessTag
    command: str
    env: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str | None = None
    timeout_ms: int | None = None
    limits: Limits | None = None


class ProcessInfo(_Message, frozen=True):
    """A session process and what became of it."""

    tag: str
    state: Literal["running", "exited"]
    started_at_s: float
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    ended_at_s: float | None = None


class ProcessList(_Message, frozen=True):
    processes: list[ProcessInfo]


class LogLines(_Message, frozen=True):
    """The last lines of a process's merged output."""

    tag: str
    lines: list[str]
    truncated: bool


class RuntimeErrorRecord(_Message, frozen=True):
    """One deduplicated runtime error (from the browser reporter or process output)."""

    fingerprint: str
    type: str
    category: str
    message: str
    source: str
    count: int
    first_seen_s: float
    last_seen_s: float
    file: str | None = None
    line: int | None = None
    column: int | None = None
    top_frame: str | None = None


class RuntimeErrors(_Message, frozen=True):
    errors: list[RuntimeErrorRecord]


class Diagnostic(_Message, frozen=True):
    """One static-analysis finding."""

    file: str
    line: int
    column: int
    severity: str
    message: str
    tool: str
    code: str | None = None


class ToolStatus(_Message, frozen=True):
    """Whether a checker could run (``available`` False is not "no findings")."""

    tool: str
    available: bool
    detail: str | None = None


class AnalysisResult(_Message, frozen=True):
    diagnostics: list[Diagnostic]
    tools: list[ToolStatus]
