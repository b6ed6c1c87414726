"""Programmatic tool calling: ``POST /exec/programmatic`` (and ``/cancel``).

The caller's Python runs with each of its tools as an async function (or, with
``lang: "bash"``, the caller's bash with each tool as a shell function taking one
JSON string argument, whose stdout is the tool's result). When the
code awaits tools, the answer is ``{status: "tool_call_required",
continuation_token, tool_calls: [{id, name, input}]}``; the caller runs the tools
and posts ``{continuation_token, tool_results: [{call_id, result, is_error,
error_message?}]}``, and the code continues where it waited; at the end
``{status: "completed", stdout, stderr, files, session_id}`` or ``{status: "error",
error, stderr}``.

The paused code lives in a code context of a runtime session (the call's hint,
or a session of its own that is destroyed at the end): the first round runs
``RUNTIME`` there, which starts the code as a task on an event loop thread of
the interpreter; each round's cell waits until the task finishes or has awaited
tools and gone quiet, and answers with a JSON result. Every round goes through
``ExecutionService.run_code`` (one session turn: held, attached, checkpointed).

A continuation token is random, single-use, bound to its tenant, and expires
(``TOKEN_TTL_S``); a paused run is kept by this process, so a continuation must
come back to the worker that answered the last round (a load balancer's
affinity). At most ``MAX_ROUND_TRIPS`` rounds.

``programmatic_runtime.py`` holds what runs in the interpreter (``RUNTIME``) and
tools' names there; ``programmatic_wire.py`` the request shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sandcell_protocol import (
    ExecuteRequest,
    OutputFile,
    ProtocolError,
    runtime_session_id,
    validate_hint,
)
from sandcell_protocol import contexts as cx

from ...errors import SandboxError, SandboxNotFoundError
from ...handle import SandboxHandle
from ...sessions.execution import Identity
from ..errors import JSON_MEDIA_TYPE, read_body
from .api import LibreChatApi
from .auth import Caller
from .delivery import keep_outputs, kept_outputs
from .errors import librechat_json
from .ids import new_nanoid
from .inputs import ResolvedInput, refs_of, resolve_inputs
from .outputs import KeptOutputs, deleted_inputs
from .programmatic_runtime import BASH_RUNTIME, RUNTIME, bash_name, python_name
from .programmatic_wire import CancelBody, ProgrammaticBody, ToolResult

__all__ = [
    "MAX_ROUND_TRIPS",
    "RUNTIME",
    "TOKEN_TTL_S",
    "Programmatic",
    "bash_name",
    "python_name",
]

log = logging.getLogger(__name__)

MAX_ROUND_TRIPS = 20
TOKEN_TTL_S = 600.0
REQUEST_ID_HEADER = "x-librechat-code-request-id"
WORKSPACE_HEADER = "x-librechat-code-workspace-id"
"""The client's attached-workspace bash (a persistent project per conversation): not
served, and refused with the capability code the client turns into "do not retry"."""
_QUIET_S = 0.05
_BASH_QUIET_S = 0.2
"""Bash's calls each start a process or two (``mkfifo``): parallel ones (``&``) come
further apart than Python's, and should still share a round."""
_PYTHON_LANGS = frozenset({"py", "python"})


@dataclass
class _Run:
    """A programmatic run between rounds (or in one)."""

    namespace: str
    user: str
    owner: str | None
    """Who owns the outputs (``LibreChatApi.owner_of``)."""
    hint: str
    own_session: bool
    context_id: str
    timeout_ms: int
    inputs: list[ResolvedInput]
    kept: KeptOutputs
    """The outputs over the inline cap, read in each round (the byte cap is per run)."""
    expires_at: float
    quiet_s: float = _QUIET_S
    """How long the code must have made no new tool call before a round answers its calls."""
    rounds: int = 0
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    outputs: dict[str, OutputFile] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    """The inputs gone from the workspace as of the last round (``deleted_files``)."""
    runtime_status: str = "new"
    """``new`` when the call's runtime session had no record before its first round, else
    ``reused``: answered with the session's id when the call named the session."""

    async def collect(self, handle: SandboxHandle, files: list[OutputFile]) -> None:
        """A round's collection: its outputs over the inline cap, and the inputs gone."""
        await self.kept.collect(handle, files)
        if self.inputs:
            written = [*self.outputs.values(), *files]
            names = [item.wire.name for item in self.inputs]
            self.deleted = await deleted_inputs(handle, names, written)


class Programmatic:
    """The programmatic routes' state: paused runs by token, rounds in flight by request id."""

    def __init__(
        self,
        api: LibreChatApi,
        *,
        clock: Callable[[], float] = time.monotonic,
        new_token: Callable[[], str] = lambda: secrets.token_urlsafe(32),
    ) -> None:
        self._api = api
        self._clock = clock
        self._new_token = new_token
        self._paused: dict[str, _Run] = {}
        # Keyed by (tenant, token user, request id): the id is the caller's, so another
        # caller sending the same one must neither replace nor drop this entry.
        self._in_flight: dict[tuple[str, str | None, str], _Run] = {}
        self._cleanups: set[asyncio.Task[None]] = set()

    async def handle(self, request: Request) -> Response:
        api = self._api
        caller = api.auth.caller(request)  # before the body: a stranger learns nothing of it
        try:
            body = msgspec.json.decode(await read_body(request), type=ProgrammaticBody, strict=True)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"programmatic body: {exc}") from None
        self._expire()
        if request.headers.get(WORKSPACE_HEADER) is not None:
            return librechat_json(
                422,
                {
                    "error": "stateful_workspace_unsupported",
                    "message": "attached workspaces are not served here",
                },
            )
        if body.continuation_token is not None:
            run = self._paused.get(body.continuation_token)
            if run is not None and _owns(caller, run):
                del self._paused[body.continuation_token]  # single-use
            else:
                # Unknown, used, expired or another tenant's: all alike (and another
                # tenant's attempt leaves the run to its owner).
                return librechat_json(
                    400, {"error": "invalid_continuation", "message": "unknown continuation token"}
                )
            cell = (
                f"__sandcell_ptc__.resume(__import__('json').loads("
                f"{json.dumps(_results(body.tool_results))!r}))\n"
                f"__sandcell_ptc__.wait({run.quiet_s})"
            )
            return await self._round(request, caller, run, cell, files=[])
        bash = body.lang == "bash"
        if not bash and body.lang is not None and body.lang not in _PYTHON_LANGS:
            return librechat_json(400, {"error": "bad_request", "message": "Unsupported language"})
        if not body.code:
            raise ProtocolError("programmatic: code is required")
        named = bash_name if bash else python_name
        tools = {named(tool.name): tool.name for tool in body.tools or []}
        if "" in tools:
            raise ProtocolError("programmatic: a tool name has no identifier characters")
        user = api.user_of(caller, request, None)
        owner = api.owner_of(caller, request, None)
        hint = body.runtime_session_hint
        if request.headers.get("x-codeapi-expected-profile", "").lower() == "default":
            hint = None
        own_session = hint is None
        if hint is None:
            hint = f"ptc-{new_nanoid()}"
        validate_hint(hint)
        inputs = await resolve_inputs(api.files, caller, body.files)
        run = _Run(
            namespace=caller.namespace,
            user=user,
            owner=owner,
            hint=hint,
            own_session=own_session,
            context_id=f"ptc-{new_nanoid()}",
            timeout_ms=max(1, round(api.timeout_s(body.timeout) * 1000)),
            inputs=inputs,
            kept=kept_outputs(api, inputs),
            expires_at=self._clock() + TOKEN_TTL_S,
            quiet_s=_BASH_QUIET_S if bash else _QUIET_S,
        )
        if not own_session:
            # Looked up before the first round (which makes the record), as /exec does.
            record = await api.manager.record(runtime_session_id(run.namespace, user, hint))
            run.runtime_status = "new" if record is None else "reused"
        if bash:
            runtime, kind = f"{RUNTIME}\n{BASH_RUNTIME}", "_SandcellBashProgrammatic"
        else:
            runtime, kind = RUNTIME, "_SandcellProgrammatic"
        cell = (
            f"{runtime}\n"
            f"__sandcell_ptc__ = {kind}({body.code!r}, {tools!r})\n"
            f"__sandcell_ptc__.wait({run.quiet_s})"
        )
        return await self._round(request, caller, run, cell, files=refs_of(inputs))

    async def _round(
        self, request: Request, caller: Caller, run: _Run, cell: str, *, files: list[Any]
    ) -> Response:
        api = self._api
        run.rounds += 1
        if run.rounds > MAX_ROUND_TRIPS + 1:
            await self._finish(run)
            return _json({"status": "error", "error": "too many round trips", "stderr": ""})
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id:
            self._in_flight[_scope(caller, request_id)] = run
        try:
            async with api.limiter.slot(caller.namespace):
                result = await api.execution.run_code(
                    ExecuteRequest(
                        language="python", code=cell, timeout_ms=run.timeout_ms, files=files
                    ),
                    Identity(namespace=run.namespace, user_id=run.user),
                    hint=run.hint,
                    context_id=run.context_id,
                    collect=run.collect,
                )
        except BaseException:
            await self._finish(run)
            raise
        finally:
            if request_id:
                self._in_flight.pop(_scope(caller, request_id), None)
        run.stdout.append(result.stdout)
        run.stderr.append(result.stderr)
        for output in result.files:
            run.outputs[output.name] = output
        state = _state_of(result)
        if state.get("state") == "calls":
            token = self._new_token()
            run.expires_at = self._clock() + TOKEN_TTL_S
            self._paused[token] = run
            return _json(
                {
                    "status": "tool_call_required",
                    "continuation_token": token,
                    "tool_calls": state["calls"],
                }
            )
        await self._finish(run)
        stderr = "".join(run.stderr)
        if state.get("state") == "done":
            session_id = api.new_id()
            files, delivery = await keep_outputs(
                api, caller, run.owner, session_id, list(run.outputs.values()), run.inputs, run.kept
            )
            answer: dict[str, Any] = {
                "status": "completed",
                "session_id": session_id,
                "stdout": "".join(run.stdout),
                "stderr": stderr,
                "files": [msgspec.to_builtins(item) for item in files],
            }
            if delivery is not None:
                answer["artifact_delivery"] = delivery
            if run.deleted:
                answer["deleted_files"] = run.deleted
            if not run.own_session:
                # The client echoes both beside session_id in its artifact.
                answer["runtime_session_id"] = _session_id(run)
                answer["runtime_status"] = run.runtime_status
            return _json(answer)
        error = state.get("error") or _failure(result)
        return _json({"status": "error", "error": error, "stderr": stderr})

    async def cancel(self, request: Request) -> Response:
        caller = self._api.auth.caller(request)
        try:
            body = msgspec.json.decode(await read_body(request), type=CancelBody, strict=True)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"cancel body: {exc}") from None
        run = self._in_flight.get(_scope(caller, body.request_id))
        if run is None:
            return librechat_json(404, {"error": "not_found", "message": "no such request"})
        session_id = _session_id(run)
        with contextlib.suppress(SandboxError, SandboxNotFoundError):
            await self._api.execution.contexts.interrupt(session_id, run.context_id)
        return librechat_json(200, {"status": "cancelled"})

    def _expire(self) -> None:
        now = self._clock()
        for token, run in list(self._paused.items()):
            if run.expires_at <= now:
                del self._paused[token]
                task = asyncio.create_task(self._finish(run))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def _finish(self, run: _Run) -> None:
        """Drop the run's context, and its session when it had one of its own (best effort)."""
        execution = self._api.execution
        session_id = _session_id(run)
        try:
            if run.own_session:
                await execution.destroy_session(session_id)
            else:
                await execution.contexts.delete(session_id, run.context_id)
        except Exception as exc:
            log.warning("programmatic run clean-up failed: %s", type(exc).__name__)


def _session_id(run: _Run) -> str:
    return runtime_session_id(run.namespace, run.user, run.hint)


def _results(items: list[ToolResult] | None) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(item) for item in items or []]


def _state_of(result: cx.ContextRunResult) -> dict[str, Any]:
    for item in result.results:
        value = item.data.get("application/json")
        if isinstance(value, dict) and value.get("state") in ("calls", "done", "error"):
            return value
    return {}


def _failure(result: cx.ContextRunResult) -> str:
    if result.status == cx.ContextStatus.TIMEOUT:
        return "Execution failed or timed out"
    if result.error is not None:
        return f"{result.error.name}: {result.error.value}"
    if result.context_lost:
        return "the paused code was lost (its sandbox was recycled)"
    return result.message or "Execution failed or timed out"


def _json(body: dict[str, Any]) -> Response:
    return Response(msgspec.json.encode(body), media_type=JSON_MEDIA_TYPE)


def _owns(caller: Caller, run: _Run) -> bool:
    """Whether ``caller`` may continue ``run``: its tenant's, and (every JWT caller shares
    one tenant) its token user's when a token vouches for one."""
    if run.namespace != caller.namespace:
        return False
    return caller.token_user is None or caller.token_user == run.user


def _scope(caller: Caller, request_id: str) -> tuple[str, str | None, str]:
    """Where a round's ``X-LibreChat-Code-Request-ID`` is kept: per tenant and token user."""
    return (caller.namespace, caller.token_user, request_id)
