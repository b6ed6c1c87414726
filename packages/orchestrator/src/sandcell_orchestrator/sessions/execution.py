"""ExecutionService: the code-interpreter path, one turn at a time, on ``SandboxManager``.

``SANDCELL_RUNTIME_SESSION_MODE``:

- ``stateless``: one sandbox per call; deliver inputs, execute, discard (also on
  cancel and error: ``stateless.run_stateless``).
- ``affinity`` / ``strict`` with a hint: derive the runtime session id; then, on
  the manager: hold the session, attach its sandbox (reuse the warm one, or launch
  one and restore the last checkpoint before anything runs), push missing inputs,
  execute, checkpoint (fenced, best-effort), touch, release.
- Without a hint ``affinity`` runs statelessly and ``strict`` refuses.

Fail closed on state, open on speed: a failed checkpoint keeps the previous one;
a failed restore never runs the turn on an empty workspace; a lost lock aborts
the work in flight; a sandbox that may be dirty is recycled, not reused. The
lifecycle, the registry and the store are the manager's; a session turn's steps
from hold to commit are ``turn.SessionTurns``'; this module chooses the path and
gives the turn its work (a job, or a cell in a code context).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from sandcell_protocol import EgressPolicy, ExecuteRequest, ExecuteResult, runtime_session_id
from sandcell_protocol.contexts import ContextEvent, ContextRun, ContextRunResult

from ..config import Budgets, SessionMode
from ..errors import SessionRequiredError
from ..handle import SandboxHandle
from ..metrics import Metrics
from ..providers.base import SandboxProvider, SandboxSpec
from ..registry import IdempotentAnswer, SessionRecord, SessionRegistry
from ..snapshots import SnapshotStore
from ..stored import StoredDecoder
from .contexts import SessionContexts, default_context_id, prime_inputs, refuse_for_contexts
from .inputs import InputSource, scope_inputs
from .manager import SandboxManager
from .output import Collect, OnOutput, run_job
from .stateless import run_stateless
from .turn import Keyed, SessionTurns
from .warm import WarmLimit

__all__ = ["ExecutionService", "Identity", "ResultCodec"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ResultCodec:
    """How a keyed turn's result is saved in the store (with its checkpoint, and by
    key once committed) and read back by a retry that finds the turn applied.

    The default saves the ``ExecuteResult``; a surface whose answer is more than the
    result (LibreChat's names the output files it stored) saves that answer with it.
    ``encode`` gets the result as its answer says once committed (durable)."""

    encode: Callable[[ExecuteResult], bytes]
    decode: Callable[[bytes], ExecuteResult]


RESULT_CODEC = ResultCodec(
    encode=msgspec.json.encode,
    # A newer worker's result may carry fields this one does not know (stored.py).
    decode=StoredDecoder(ExecuteResult).decode,
)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who runs the code: a tenant namespace and a user within it."""

    namespace: str
    user_id: str


class ExecutionService:
    """Runs ``ExecuteRequest``s in sandboxes, statelessly or in runtime sessions.

    Give it the process's ``SandboxManager`` (``open_services`` does), or the
    provider, registry and store to build one over.
    """

    def __init__(
        self,
        *,
        manager: SandboxManager | None = None,
        provider: SandboxProvider | None = None,
        registry: SessionRegistry | None = None,
        store: SnapshotStore | None = None,
        mode: SessionMode = "affinity",
        budgets: Budgets | None = None,
        checkpoint_max_bytes: int = 1 << 30,
        inputs: InputSource | None = None,
        metrics: Metrics | None = None,
        spec: SandboxSpec | None = None,
        wall_clock: Callable[[], float] = time.time,
        keep_warm: bool = True,
        checkpoint_retry_s: float = 10.0,
        max_warm_per_tenant: int = 64,
    ) -> None:
        if manager is None:
            if provider is None or registry is None or store is None:
                raise TypeError(
                    "ExecutionService needs a manager, or a provider, registry and store"
                )
            manager = SandboxManager(
                provider,
                registry,
                store,
                budgets=budgets,
                checkpoint_max_bytes=checkpoint_max_bytes,
                metrics=metrics,
                wall_clock=wall_clock,
            )
        self.manager = manager
        self.mode = mode
        self.inputs = inputs
        self.metrics = manager.metrics
        self.spec = spec or SandboxSpec()
        self.keep_warm = keep_warm
        """False: park each session's sandbox at the end of its turn (see ``open_services``)."""
        self.warm = WarmLimit(manager.suspend, max_per_tenant=max_warm_per_tenant)
        """A tenant's warm sandboxes on this worker, at most so many (``warm.py``)."""
        self.checkpoint_retry_s = checkpoint_retry_s
        """How long a turn retries a failed checkpoint before keeping the previous one."""
        self.session_wait_ms = 0
        """How long a turn waits for a busy session before ``SessionBusyError`` (0: not at all)."""
        self.contexts = SessionContexts(manager, spec=self.spec)
        """Context operations by session id (``run_code`` runs the cells)."""
        self.turns = SessionTurns(manager, self)
        """Runs the session turns, reading the settings above from this service."""

    # -- entry point ----------------------------------------------------------

    async def execute(
        self,
        request: ExecuteRequest,
        identity: Identity,
        *,
        hint: str | None = None,
        on_output: OnOutput | None = None,
        egress: EgressPolicy | None = None,
        collect: Collect | None = None,
        answer: Callable[[ExecuteResult], IdempotentAnswer | None] | None = None,
        turn_key: str | None = None,
        saved: ResultCodec = RESULT_CODEC,
    ) -> ExecuteResult:
        """Run ``request`` for ``identity``; ``hint`` names a runtime session.

        ``on_output`` receives the job's stdout/stderr chunks as they are produced
        (the result still carries all of it, as the runner captured it).
        ``collect`` is called with the sandbox and the output files after the job,
        while the sandbox still holds them (see ``output.Collect``).

        ``answer`` (a keyed request's: its idempotent answer for a result) makes a
        session turn exactly-once: the fenced record write that commits the turn
        stores that answer too, and an interrupted turn keeps none of its writes
        (the retry runs it again on the last commit). ``turn_key`` (the stored
        idempotency key, with ``answer``) also saves the result with the turn's
        checkpoint: a retry that finds the session's newest checkpoint written by
        this very turn, the registry having forgotten it (a wiped Redis), gets that
        result instead of a second run (``saved``: how it is saved and read back). A
        result ``answer`` gives None for has no answer to keep (its surface answers it
        as an error).

        Input refs are scoped to ``identity.namespace`` first (``scope_inputs``): a
        ref can only ever name this tenant's objects. ``egress`` replaces the
        sandbox's egress policy before the job runs (None: as it is, or the spec's).
        """
        request = scope_inputs(request, identity.namespace)
        if self.mode == "stateless":
            return await self._stateless(request, on_output, egress, collect)
        if hint is None:
            if self.mode == "strict":
                raise SessionRequiredError("strict runtime-session mode needs a session hint")
            self.metrics.inc("sandcell_fallbacks_total", reason="no_hint")
            return await self._stateless(request, on_output, egress, collect)
        session_id = runtime_session_id(identity.namespace, identity.user_id, hint)
        result = await self.execute_in_session(
            request,
            session_id,
            on_output=on_output,
            egress=egress,
            collect=collect,
            answer=answer,
            turn_key=turn_key,
            saved=saved,
        )
        if self.keep_warm:
            await self.warm.used(identity.namespace, session_id)
        return result

    def runs_stateless(self, hint: str | None) -> bool:
        """Whether ``execute`` with ``hint`` runs statelessly (no session, nothing kept)."""
        return self.mode == "stateless" or (hint is None and self.mode != "strict")

    def _spec_for(self, egress: EgressPolicy | None) -> SandboxSpec:
        return self.spec if egress is None else dataclasses.replace(self.spec, egress=egress)

    async def _stateless(
        self,
        request: ExecuteRequest,
        on_output: OnOutput | None,
        egress: EgressPolicy | None,
        collect: Collect | None,
    ) -> ExecuteResult:
        return await run_stateless(
            self.manager,
            request,
            spec=self._spec_for(egress),
            inputs=self.inputs,
            timeout_s=self._turn_timeout(request),
            on_output=on_output,
            collect=collect,
        )

    # -- sessions -------------------------------------------------------------

    async def execute_in_session(
        self,
        request: ExecuteRequest,
        session_id: str,
        *,
        on_output: OnOutput | None = None,
        egress: EgressPolicy | None = None,
        collect: Collect | None = None,
        answer: Callable[[ExecuteResult], IdempotentAnswer | None] | None = None,
        turn_key: str | None = None,
        saved: ResultCodec = RESULT_CODEC,
    ) -> ExecuteResult:
        """The session path for an already-derived ``rt_…`` id.

        ``request``'s input refs must already be scoped (``execute`` does it).
        ``answer``, ``turn_key`` and ``saved`` as for ``execute``.
        """

        async def run(handle: SandboxHandle) -> ExecuteResult:
            result = await run_job(
                handle,
                request,
                session_id=session_id,
                timeout_s=self._turn_timeout(request),
                on_output=on_output,
            )
            if collect is not None:
                await collect(handle, result.files)
            self.metrics.inc("sandcell_executions_total", status=str(result.status))
            return result

        def answered(result: ExecuteResult, durable: bool) -> IdempotentAnswer | None:
            assert answer is not None
            return answer(msgspec.structs.replace(result, durable=durable))

        keyed = None
        if answer is not None and turn_key is not None:
            keyed = Keyed(
                turn_key,
                # Saved as its answer says once committed: durable.
                encode=lambda result: saved.encode(msgspec.structs.replace(result, durable=True)),
                decode=saved.decode,
            )
        result, durable = await self._session_turn(
            session_id,
            request,
            run,
            changed=lambda result: result.workspace_changed,
            egress=egress,
            answer=answered if answer is not None else None,
            keyed=keyed,
        )
        # The answer tells the truth about durability: a client (or the chaos check)
        # counts a turn as committed only once one of its answers says it was saved.
        return msgspec.structs.replace(result, durable=durable)

    async def run_code(
        self,
        request: ExecuteRequest,
        identity: Identity,
        *,
        hint: str | None,
        context_id: str | None = None,
        on_event: Callable[[ContextEvent], None] | None = None,
        egress: EgressPolicy | None = None,
        collect: Collect | None = None,
    ) -> ContextRunResult:
        """Run ``request.code`` in a code context of the session ``hint`` names.

        The same turn as ``execute``: the session is held, its sandbox attached (a
        new one restores the checkpoint first), inputs delivered, the cell run in
        the context (``context_id``; None: the language's default context, created
        on first use), and the workspace checkpointed when the cell changed it.
        ``on_event`` gets the run's events as they happen; ``egress`` is the
        sandbox's egress policy from this turn on, and ``collect`` reads the cell's
        output files, as for ``execute``. Contexts keep state, so a hint is required
        in every mode.
        """
        if hint is None:
            raise SessionRequiredError("code contexts live in a runtime session: give a hint")
        refuse_for_contexts(request)
        request = scope_inputs(request, identity.namespace)
        session_id = runtime_session_id(identity.namespace, identity.user_id, hint)
        run = ContextRun(code=request.code, timeout_ms=request.timeout_ms, env=request.env)
        wanted = context_id or default_context_id(request.language)

        async def in_context(handle: SandboxHandle) -> ContextRunResult:
            if request.files or request.inline_files:
                await prime_inputs(handle, request, timeout_s=self._turn_timeout(request))
            result = await handle.contexts.run(
                run,
                context_id=wanted,
                language=request.language,
                timeout_s=self._turn_timeout(request),
                on_event=on_event,
            )
            if collect is not None:
                await collect(handle, result.files)
            self.metrics.inc("sandcell_context_runs_total", status=str(result.status))
            return result

        # No /health round trip before a cell (it cost as much as the cell): if the warm
        # sandbox died, its interpreters died with it, and the run's own failure says
        # so (retryable; the next run restores the files and answers context_lost).
        result, _ = await self._session_turn(
            session_id,
            request,
            in_context,
            changed=lambda result: result.workspace_changed,
            egress=egress,
            verify=False,
        )
        if self.keep_warm:
            await self.warm.used(identity.namespace, session_id)
        return result

    async def _session_turn(
        self,
        session_id: str,
        request: ExecuteRequest,
        work: Callable[[SandboxHandle], Awaitable[_T]],
        *,
        changed: Callable[[_T], bool | None],
        egress: EgressPolicy | None = None,
        verify: bool = True,
        answer: Callable[[_T, bool], IdempotentAnswer | None] | None = None,
        keyed: Keyed[_T] | None = None,
    ) -> tuple[_T, bool]:
        """One turn in a session: hold, attach (restore first), egress, inputs, ``work``,
        checkpoint unless ``changed`` says the workspace is as it was, touch. With
        ``work``'s result: whether the turn is durable (in a checkpoint). ``answer``:
        the turn's idempotent answer for (result, durable), stored by its commit;
        ``keyed``: its result saved with its checkpoint, and found there by a retry."""
        with self.metrics.timer("sandcell_turn_duration_seconds"):
            return await self.turns.run(
                session_id,
                request,
                work,
                spec=self._spec_for(egress),
                changed=changed,
                egress=egress,
                verify=verify,
                answer=answer,
                keyed=keyed,
            )

    def _turn_timeout(self, request: ExecuteRequest) -> float:
        return request.timeout_ms / 1000 + self.manager.budgets.health_s

    # -- administration (the manager's; forwarded for the CLI and the service) ----

    async def list_sessions(self) -> list[SessionRecord]:
        return await self.manager.list()

    async def destroy_session(self, session_id: str) -> bool:
        """Destroy the session's sandbox, delete its checkpoints and record."""
        return await self.manager.destroy(session_id)

    async def suspend_session(self, session_id: str) -> bool:
        """Suspend an idle session (the manager's one suspend policy)."""
        return await self.manager.suspend(session_id)

    async def sweep_idle(self, *, idle_s: float) -> int:
        """Suspend sessions idle past ``idle_s``; tidy lost rows; collect old objects."""
        return await self.manager.sweep(idle_s=idle_s)

    async def aclose(self, *, destroy_sandboxes: bool) -> None:
        """Close the manager's clients (see ``SandboxManager.aclose``)."""
        await self.manager.aclose(destroy_sandboxes=destroy_sandboxes)
