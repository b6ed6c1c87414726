"""The wire of ``POST /exec/programmatic`` and ``/exec/programmatic/cancel``: request shapes."""

from __future__ import annotations

from typing import Any

import msgspec

from .wire import InFile, NonNegativeInt

__all__ = ["CancelBody", "ProgrammaticBody", "ToolDef", "ToolResult"]


class ToolDef(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: Any = None


class ToolResult(msgspec.Struct, frozen=True, kw_only=True):
    call_id: str
    result: Any = None
    is_error: bool = False
    error_message: str | None = None


class ProgrammaticBody(msgspec.Struct, frozen=True, kw_only=True):
    """A first round (``code``, ``tools``) or a continuation (``continuation_token``).

    Not ``forbid_unknown_fields``, for the reason ``wire.ExecBody`` gives."""

    lang: str | None = None
    """``bash`` for the client's bash programmatic tool; Python otherwise (``py``, or none)."""
    code: str | None = None
    tools: list[ToolDef] | None = None
    session_id: str | None = None
    timeout: NonNegativeInt | None = None
    files: list[InFile] | None = None
    runtime_session_hint: str | None = None
    continuation_token: str | None = None
    tool_results: list[ToolResult] | None = None

    def __repr__(self) -> str:
        continuing = self.continuation_token is not None
        return f"ProgrammaticBody(tools={len(self.tools or [])}, continuing={continuing})"


class CancelBody(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
