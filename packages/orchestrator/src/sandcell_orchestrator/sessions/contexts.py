"""Code contexts of runtime sessions, for the service and the CLI.

``ExecutionService.run_code`` runs a cell through the same turn as ``execute``
(``execution.py``); this module holds what that turn needs to know of contexts
and the other context operations by session id (``SessionContexts``): create,
restart and delete attach the session's sandbox under its hold like a turn (a
suspended session is restored first); list and interrupt take no hold, because a
running cell holds the session.
"""

from __future__ import annotations

from sandcell_protocol import ExecuteRequest, RunStatus
from sandcell_protocol import contexts as cx

from ..contexts import default_context_id
from ..errors import RunnerRequestError, SandboxError, SandboxNotFoundError
from ..handle import SandboxHandle
from ..providers.base import SandboxSpec
from .manager import SandboxManager

__all__ = ["SessionContexts", "default_context_id", "prime_inputs", "refuse_for_contexts"]


def refuse_for_contexts(request: ExecuteRequest) -> None:
    """A context runs code, not a program: ``args``, ``stdin`` and ``limits`` have no
    meaning there (the context's limits are its session's), so they are refused."""
    given = [
        name
        for name, present in (
            ("args", bool(request.args)),
            ("stdin", request.stdin is not None),
            ("limits", request.limits is not None),
        )
        if present
    ]
    if given:
        raise RunnerRequestError(
            f"refused before sending: {', '.join(given)} do not apply to a code context",
            code="bad_request",
        )


async def prime_inputs(handle: SandboxHandle, request: ExecuteRequest, *, timeout_s: float) -> None:
    """Write the request's files into the session workspace before the cell runs.

    Only the runner's priming step writes inputs into a workspace, and it runs as
    part of an execute: an empty ``sh`` job carries them in, so a context run uses
    the one priming path there is.
    """
    carrier = ExecuteRequest(
        language="sh",
        code=":",
        files=request.files,
        inline_files=request.inline_files,
        timeout_ms=30_000,
    )
    result = await handle.runner.execute(carrier, session_id=handle.session_id, timeout_s=timeout_s)
    if result.status is not RunStatus.OK:
        raise SandboxError(f"the inputs could not be written ({result.status.value})")


class SessionContexts:
    """Context operations on a session by its ``rt_…`` id."""

    def __init__(self, manager: SandboxManager, *, spec: SandboxSpec) -> None:
        self._manager = manager
        self._spec = spec

    async def create(self, session_id: str, create: cx.ContextCreate) -> cx.ContextInfo:
        async with self._manager.hold(session_id) as hold:
            attached = await self._manager.attach(hold, self._spec)
            info = await attached.handle.runner.contexts.create(create, session_id=session_id)
            await self._manager.touch(session_id)
            return info

    async def list(self, session_id: str) -> list[cx.ContextInfo]:
        """The contexts of the session's warm sandbox ([] when it has none: a suspended
        session runs no interpreter). Takes no hold, so it answers while a cell runs."""
        try:
            handle = await self._manager.connect(session_id)
        except SandboxNotFoundError:
            return []
        try:
            return await handle.runner.contexts.list(session_id=session_id)
        finally:
            await handle.close()

    async def restart(self, session_id: str, context_id: str) -> cx.ContextInfo:
        async with self._manager.hold(session_id) as hold:
            attached = await self._manager.attach(hold, self._spec)
            info = await attached.handle.runner.contexts.restart(context_id, session_id=session_id)
            await self._manager.touch(session_id)
            return info

    async def restart_or_create(
        self, session_id: str, context_id: str, language: str
    ) -> cx.ContextInfo:
        """A fresh interpreter under ``context_id``, whether or not it existed."""
        try:
            return await self.restart(session_id, context_id)
        except RunnerRequestError as exc:
            if exc.code != "not_found":
                raise
        create = cx.ContextCreate(language=language, context_id=context_id)
        return await self.create(session_id, create)

    async def delete(self, session_id: str, context_id: str) -> None:
        async with self._manager.hold(session_id) as hold:
            attached = await self._manager.attach(hold, self._spec)
            await attached.handle.runner.contexts.delete(context_id, session_id=session_id)

    async def interrupt(self, session_id: str, context_id: str) -> cx.ContextInfo:
        """SIGINT to the context's running cell, without the session's hold (the run has it).

        ``SandboxNotFoundError`` when the session has no warm sandbox (nothing runs).
        """
        handle = await self._manager.connect(session_id)
        try:
            return await handle.runner.contexts.interrupt(context_id, session_id=session_id)
        finally:
            await handle.close()
