"""E2B's code interpreter (port 49999) on sandcell's code contexts.

``e2b-code-interpreter`` calls, on ``E2b-Sandbox-Port: 49999``:

    POST   /execute                 {code, context_id?, language?, env_vars?} -> NDJSON
    POST   /contexts                {language?, cwd?} -> {id, language, cwd}
    GET    /contexts                [{id, language, cwd}]
    DELETE /contexts/{id}           204
    POST   /contexts/{id}/restart   204

Each is one call on the runner's code contexts (``/v1/session/contexts``, a
long-lived interpreter in the session's jail). ``/execute`` without a context
runs in the language's default context (made on first use). Languages are E2B's
names for those the runner has drivers for: ``python`` and ``javascript``/``js``
(a node context); E2B's others (``typescript``, ``r``, ``java``, ``bash``) are a
400 ``unsupported_language`` naming what is served. Its answer, E2B's NDJSON
lines, and what a client that goes away does to its cell: ``interpreter_stream.py``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sandcell_protocol import ProtocolError, encode
from sandcell_protocol import contexts as cx
from sandcell_protocol import sandbox_messages as sm

from ..errors import RunnerRequestError, SessionConflictError
from ..runner.contexts import RunnerContexts
from ..serve.idempotency import (
    IN_FLIGHT_RETRY_AFTER_S,
    Idempotency,
    IdempotencyConflict,
    Replay,
    idempotency_key,
    replayed,
)
from .errors import E2bError, e2b_error_response, read_message
from .interpreter_stream import NDJSON, Started, kept_stream, watched_stream
from .sandboxes import E2bSandbox

__all__ = ["CELL_TIMEOUT_MS", "INTERPRETER_PORT", "interpreter_route"]

INTERPRETER_PORT = 49999
_NDJSON = "application/x-ndjson"
_LANGUAGES = {
    "python": "python",
    "python3": "python",
    "javascript": "node",
    "js": "node",
}
"""E2B's language names (its server's ``normalize_language``) onto the runner's
context languages; E2B's others (``typescript``/``ts``, ``r``, ``java``, ``bash``)
have no context driver here and are refused by name."""
_E2B_NAMES = {"python": "python", "node": "javascript"}
"""A runner context's language as E2B's server names it back (``Context.language``)."""
_SERVED = "python, javascript (js)"
CELL_TIMEOUT_MS = 3_600_000
"""What a cell asks the runner for: E2B's server sets a cell no limit (the SDK's
``timeout`` is the client's, and a client that goes interrupts its cell), so a cell
runs to the runner's cap (``SANDCELL_RUNNER_MAX_TIMEOUT_MS``, 600 s by default), not
to its default for a sandcell job (``SANDCELL_RUNNER_TIMEOUT_MS``, 30 s)."""
_SURFACE = "e2b/execute"
"""The idempotency surface of ``/execute`` (keys are scoped by it, the tenant and sandbox)."""


class _Execute(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    code: str
    context_id: str | None = None
    language: str | None = None
    env_vars: dict[str, str] | None = None


class _NewContext(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    language: str | None = None
    cwd: str | None = None


class _Context(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    language: str
    cwd: str


class _Contexts:
    """The sandbox's code contexts: ``RunnerClient.contexts`` in the sandbox's session."""

    def __init__(self, sandbox: E2bSandbox) -> None:
        handle = sandbox.handle
        if handle is None or handle.session_id is None:
            raise E2bError(502, "not_found", f"sandbox {sandbox.sandbox_id} is paused")
        self._routes: RunnerContexts = handle.runner.contexts
        self._session_id = handle.session_id

    async def create(self, create: cx.ContextCreate) -> cx.ContextInfo:
        return await self._routes.create(create, session_id=self._session_id)

    async def list(self) -> list[cx.ContextInfo]:
        return await self._routes.list(session_id=self._session_id)

    async def delete(self, context_id: str) -> None:
        await self._routes.delete(context_id, session_id=self._session_id)

    async def restart(self, context_id: str) -> cx.ContextInfo:
        return await self._routes.restart(context_id, session_id=self._session_id)

    async def interrupt(self, context_id: str) -> cx.ContextInfo:
        return await self._routes.interrupt(context_id, session_id=self._session_id)

    def run(self, context_id: str, run: cx.ContextRun) -> AsyncIterator[cx.ContextEvent]:
        return self._routes.run_stream(context_id, run, session_id=self._session_id)


def _language(raw: str | None) -> str:
    language = _LANGUAGES.get((raw or "python").strip().lower())
    if language is None:
        raise E2bError(
            400,
            "unsupported_language",
            f"language {(raw or '')[:40]!r} is not served by this sandbox (served: {_SERVED})",
        )
    return language


def _unsupported(exc: RunnerRequestError, language: str) -> E2bError | None:
    """The runner's refusal of a language it has no interpreter for (no ``node`` on
    the host), in E2B's name for it."""
    if exc.code != "unsupported_language":
        return None
    name = _E2B_NAMES.get(language, language)
    return E2bError(
        400,
        "unsupported_language",
        f"language {name!r}: this sandbox has no {language} interpreter installed",
    )


async def _create(contexts: _Contexts, create: cx.ContextCreate) -> cx.ContextInfo:
    try:
        return await contexts.create(create)
    except RunnerRequestError as exc:
        raise _unsupported(exc, create.language) or exc from None


def _context(info: cx.ContextInfo) -> _Context:
    return _Context(
        id=info.context_id,
        language=_E2B_NAMES.get(info.language, info.language),
        cwd=sm.sandbox_display_path(info.cwd),
    )


def _json(value: object, status: int = 200) -> Response:
    return Response(encode(value), status_code=status, media_type="application/json")


def _unknown(context_id: str) -> E2bError:
    """The one answer for an id that names no context, as E2B's interpreter gives it
    (404, the SDK's ``NotFoundException``): never made, removed, or no valid id at all."""
    return E2bError(404, "not_found", f"Context {context_id[:64]!r} not found")


def _known_shape(context_id: str) -> str:
    """``context_id`` if it could name a context (``cx.is_context_id``); else ``_unknown``."""
    if not cx.is_context_id(context_id):
        raise _unknown(context_id)
    return context_id


def _context_missing(exc: RunnerRequestError, context_id: str) -> E2bError | None:
    # A lost context is not this: it is ContextLostError, 409 context_lost (restart it).
    return _unknown(context_id) if exc.code == "not_found" else None


async def _default_context(contexts: _Contexts, language: str) -> str:
    context_id = f"default-{language}"
    if not any(info.context_id == context_id for info in await contexts.list()):
        # A concurrent first run may make it between the list and the create: it is there.
        with contextlib.suppress(SessionConflictError):
            await _create(contexts, cx.ContextCreate(language=language, context_id=context_id))
    return context_id


async def _context_of(contexts: _Contexts, body: _Execute) -> str:
    """The context a cell runs in: the one named, else the language's default."""
    if body.context_id:
        return _known_shape(body.context_id)
    return await _default_context(contexts, _language(body.language))


async def _start(contexts: _Contexts, context_id: str, run: cx.ContextRun) -> Started:
    """Run the cell; its first event (or the refusal: an unknown or lost context)."""
    events = aiter(contexts.run(context_id, run))
    try:
        first = await anext(events)
    except RunnerRequestError as exc:
        raise _context_missing(exc, context_id) or exc from None
    except StopAsyncIteration:
        raise E2bError(502, "busy", "the cell's output ended before it began") from None
    return first, events


async def execute(
    request: Request, sandbox: E2bSandbox, *, idempotency: Idempotency | None = None
) -> Response:
    """``POST /execute``: run a cell, streamed as E2B's NDJSON lines (once per
    ``Idempotency-Key`` with ``idempotency``)."""
    key = idempotency_key(request) if idempotency is not None else None
    body = await read_message(request, _Execute, empty_ok=True)
    contexts = _Contexts(sandbox)
    # E2B's server reads an empty context_id (or language) as none given.
    if body.context_id and body.language:
        raise E2bError(400, "bad_request", "give context_id or language, not both")
    if body.context_id:
        _known_shape(body.context_id)
    else:
        _language(body.language)
    run = cx.ContextRun(
        code=body.code,
        timeout_ms=CELL_TIMEOUT_MS,
        env={**sandbox.env, **(body.env_vars or {})},
    )
    if idempotency is None or key is None:
        context_id = await _context_of(contexts, body)
        return await watched_stream(
            request,
            lambda: _start(contexts, context_id, run),
            interrupt=lambda: contexts.interrupt(context_id),
        )
    # The canonical encoding of the decoded body: what a replay must match.
    claim = await idempotency.claim(
        surface=_SURFACE,
        namespace=f"{sandbox.owner}\0{sandbox.sandbox_id}",
        key=key,
        body=encode(body),
    )
    if isinstance(claim, IdempotencyConflict):
        return _conflict(claim)
    if isinstance(claim, Replay):
        return replayed(Response(claim.body, status_code=claim.status, media_type=NDJSON))

    async def start() -> Started:
        return await _start(contexts, await _context_of(contexts, body), run)

    return await kept_stream(claim, start)


def _conflict(conflict: IdempotencyConflict) -> Response:
    """A keyed ``/execute`` not run, in E2B's error body (409 with ``Retry-After``)."""
    response = e2b_error_response(E2bError(conflict.status, str(conflict.code), conflict.message))
    if conflict.status == 409:
        response.headers["Retry-After"] = str(IN_FLIGHT_RETRY_AFTER_S)
    return response


async def create_context(request: Request, sandbox: E2bSandbox) -> Response:
    """``POST /contexts``: a new interpreter (``cwd`` a path under ``/home/user``)."""
    body = await read_message(request, _NewContext, empty_ok=True)
    cwd = None
    if body.cwd:
        try:
            cwd = sm.sandbox_path(body.cwd) or None
        except ProtocolError as exc:
            raise E2bError(400, "invalid_path", str(exc)) from None
    create = cx.ContextCreate(language=_language(body.language), cwd=cwd)
    try:
        return _json(_context(await _create(_Contexts(sandbox), create)))
    except RunnerRequestError as exc:
        if exc.code != "invalid_path" or not body.cwd:
            raise
        # The runner names the workspace's own path; the caller gave this one.
        message = f"cwd {body.cwd[:200]!r} is not a directory of the sandbox"
        raise E2bError(400, "invalid_path", message) from None


async def list_contexts(_request: Request, sandbox: E2bSandbox) -> Response:
    """``GET /contexts``."""
    return _json([_context(info) for info in await _Contexts(sandbox).list()])


def _context_id(request: Request) -> str:
    return _known_shape(str(request.path_params.get("context_id", "")))


async def delete_context(request: Request, sandbox: E2bSandbox) -> Response:
    """``DELETE /contexts/{id}``."""
    context_id = _context_id(request)
    try:
        await _Contexts(sandbox).delete(context_id)
    except RunnerRequestError as exc:
        raise _context_missing(exc, context_id) or exc from None
    return Response(status_code=204)


async def restart_context(request: Request, sandbox: E2bSandbox) -> Response:
    """``POST /contexts/{id}/restart``: a fresh interpreter, same id (variables gone)."""
    context_id = _context_id(request)
    try:
        await _Contexts(sandbox).restart(context_id)
    except RunnerRequestError as exc:
        raise _context_missing(exc, context_id) or exc from None
    return Response(status_code=204)


Handler = Callable[[Request, E2bSandbox], Awaitable[Response]]


def interpreter_route(
    method: str, path: str, *, idempotency: Idempotency | None = None
) -> tuple[Handler, dict[str, str]] | None:
    """The handler of a port-49999 request and its path parameters, or ``None``.

    ``idempotency``: what ``/execute`` claims an ``Idempotency-Key`` on (None: keys
    are not honoured)."""
    if (method, path) == ("POST", "/execute"):
        return functools.partial(execute, idempotency=idempotency), {}
    if path == "/contexts":
        if method == "POST":
            return create_context, {}
        if method == "GET":
            return list_contexts, {}
        return None
    parts = path.split("/")
    if len(parts) == 3 and parts[1] == "contexts" and method == "DELETE":
        return delete_context, {"context_id": parts[2]}
    if len(parts) == 4 and parts[1] == "contexts" and parts[3] == "restart" and method == "POST":
        return restart_context, {"context_id": parts[2]}
    return None
