"""``Contexts``: a sandbox's code contexts as feature code sees them (``SandboxHandle.contexts``).

A context is a warm interpreter in the sandbox's session: variables, imports and
figures persist between runs while the sandbox is warm (files persist through
checkpoints as always). Built on ``RunnerClient.contexts`` only, so it works the
same for every provider. A run on a context that does not exist yet creates it;
one on a lost context raises ``ContextLostError`` (``restart`` gives a fresh one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

from sandcell_protocol import contexts as cx

from .errors import RunnerRequestError, SessionConflictError, SessionRequiredError
from .runner.client import RunnerClient

__all__ = ["Contexts", "default_context_id"]

EventCallback = Callable[[cx.ContextEvent], None]


def default_context_id(language: str) -> str:
    """The context a run without a ``context_id`` uses: one per language and session."""
    context_id = f"default-{language}"
    if not cx.is_context_id(context_id):
        raise RunnerRequestError(
            f"refused before sending: no default context for language {language[:40]!r}",
            code="unsupported_language",
        )
    return context_id


class Contexts:
    """The code contexts of one sandbox's runtime session."""

    def __init__(self, runner: RunnerClient, session_id: str | None) -> None:
        self._runner = runner
        self._session_id = session_id

    def _session(self) -> str:
        if self._session_id is None:
            raise SessionRequiredError("code contexts need a sandbox bound to a runtime session")
        return self._session_id

    async def create(
        self,
        language: str = "python",
        *,
        context_id: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> cx.ContextInfo:
        """Start an interpreter; ``context_id`` names it (default: the runner picks one)."""
        create = cx.ContextCreate(
            language=language, cwd=cwd, env=dict(env or {}), context_id=context_id
        )
        return await self._runner.contexts.create(create, session_id=self._session())

    async def list(self) -> list[cx.ContextInfo]:
        return await self._runner.contexts.list(session_id=self._session())

    async def delete(self, context_id: str) -> None:
        await self._runner.contexts.delete(context_id, session_id=self._session())

    async def restart(self, context_id: str) -> cx.ContextInfo:
        """A fresh interpreter (empty namespace) under the same id."""
        return await self._runner.contexts.restart(context_id, session_id=self._session())

    async def interrupt(self, context_id: str) -> cx.ContextInfo:
        """SIGINT to the context's running cell (its variables stay)."""
        return await self._runner.contexts.interrupt(context_id, session_id=self._session())

    async def run(
        self,
        run: cx.ContextRun,
        *,
        context_id: str | None = None,
        language: str = "python",
        timeout_s: float | None = None,
        on_event: EventCallback | None = None,
    ) -> cx.ContextRunResult:
        """Run a cell; a context that does not exist yet is created first.

        ``on_event`` gets the events as they happen (the run is then streamed).
        ``ContextLostError`` when the context's interpreter is gone.
        """
        session_id = self._session()
        wanted = context_id or default_context_id(language)
        try:
            return await self._run_once(wanted, run, session_id, timeout_s, on_event)
        except RunnerRequestError as exc:
            if exc.code != "not_found":
                raise
        # Created meanwhile by another call of this session: run in that one.
        with contextlib.suppress(SessionConflictError):
            await self.create(language, context_id=wanted)
        return await self._run_once(wanted, run, session_id, timeout_s, on_event)

    async def _run_once(
        self,
        context_id: str,
        run: cx.ContextRun,
        session_id: str,
        timeout_s: float | None,
        on_event: EventCallback | None,
    ) -> cx.ContextRunResult:
        contexts = self._runner.contexts
        if on_event is None:
            return await contexts.run(context_id, run, session_id=session_id, timeout_s=timeout_s)
        events: list[cx.ContextEvent] = []
        stream = contexts.run_stream(context_id, run, session_id=session_id, timeout_s=timeout_s)
        try:
            async for event in stream:
                events.append(event)
                on_event(event)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return cx.gather_events(events)
