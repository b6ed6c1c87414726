"""ExecutionService: the code-interpreter path, one turn at a time, on ``SandboxManager``.

``SANDCELL_RUNTIME_SESSION_MODE``:

- ``stateless``: one sandbox per call; deliver inputs, execute, discard (also on
  cancel and error).
- ``affinity`` / ``strict`` with a hint: derive the runtime session id; then, on
  the manager: hold the session, attach its sandbox (reuse the warm one, or launch
  one and restore the last checkpoint before anything runs), push missing inputs,
  execute, checkpoint (fenced, best-effort), touch, release.
- Without a hint ``affinity`` runs statelessly and ``strict`` refuses.

Fail closed on state, open on speed: a failed checkpoint keeps the previous one;
a failed restore never runs the turn on an empty workspace; a lost lock aborts
the work in flight; a sandbox that may be dirty is recycled, not reused. The
lifecycle, the registry and the store are the manager's; this module only runs
the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

from sandcell_protocol import EgressPolicy, ExecuteRequest, ExecuteResult, runtime_session_id
from sandcell_protocol.contexts import ContextEvent, ContextRun, ContextRunResult

from ..config import Budgets, SessionMode
from ..errors import (
    CheckpointError,
    LockLostError,
    SandboxError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SandcellError,
    SessionBusyError,
    SessionConflictError,
    SessionRequiredError,
)
from ..handle import SandboxHandle
from ..metrics import Metrics
from ..providers.base import SandboxProvider, SandboxSpec
from ..registry import IdempotentAnswer, SessionRecord, SessionRegistry
from ..snapshots import SnapshotStore
from .contexts import SessionContexts, default_context_id, prime_inputs, refuse_for_contexts
from .inputs import InputSource, deliver_inputs, scope_inputs
from .manager import Attached, Hold, SandboxManager
from .output import Collect, OnOutput, run_job
from .persistence import TurnResult
from .sandboxes import rebind

__all__ = ["ExecutionService", "Identity"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Identity:
    """Who runs the code: a tenant namespace and a user within it."""

    namespace: str
    user_id: str


@dataclass(frozen=True, slots=True)
class _Keyed(Generic[_T]):
    """A keyed turn's stored idempotency key, and how its result is saved with its
    checkpoint and read back (``Persistence.save_turn_result``)."""

    turn_key: str
    encode: Callable[[_T], bytes]
    decode: Callable[[bytes], _T]


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
        self.checkpoint_retry_s = checkpoint_retry_s
        """How long a turn retries a failed checkpoint before keeping the previous one."""
        self.session_wait_ms = 0
        """How long a turn waits for a busy session before ``SessionBusyError`` (0: not at all)."""
        self.contexts = SessionContexts(manager, spec=self.spec)
        """Context operations by session id (``run_code`` runs the cells)."""

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
        result instead of a second run. A result ``answer`` gives None for has no
        answer to keep (its surface answers it as an error).

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
        return await self.execute_in_session(
            request,
            session_id,
            on_output=on_output,
            egress=egress,
            collect=collect,
            answer=answer,
            turn_key=turn_key,
        )

    def _spec_for(self, egress: EgressPolicy | None) -> SandboxSpec:
        return self.spec if egress is None else dataclasses.replace(self.spec, egress=egress)

    async def _stateless(
        self,
        request: ExecuteRequest,
        on_output: OnOutput | None = None,
        egress: EgressPolicy | None = None,
        collect: Collect | None = None,
    ) -> ExecuteResult:
        with self.metrics.timer("sandcell_turn_duration_seconds"):
            return await self._stateless_turn(request, on_output, egress, collect)

    async def _stateless_turn(
        self,
        request: ExecuteRequest,
        on_output: OnOutput | None,
        egress: EgressPolicy | None,
        collect: Collect | None,
    ) -> ExecuteResult:
        handle = await self.manager.launch(self._spec_for(egress))
        # A job's own workspace is gone when it ends; one that ``collect`` reads runs in
        # a throwaway runtime session instead, whose workspace lasts until the discard.
        job = handle if collect is None else rebind(handle, "rt_" + secrets.token_hex(32))
        try:
            await deliver_inputs(job, request, session_id=job.session_id, source=self.inputs)
            result = await run_job(
                job,
                request,
                session_id=job.session_id,
                timeout_s=self._turn_timeout(request),
                on_output=on_output,
            )
            if collect is not None:
                await collect(job, result.files)
            await self.manager.count_egress(handle)
        finally:
            await self.manager.discard(handle)
        self.metrics.inc("sandcell_executions_total", status=str(result.status))
        return result

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
    ) -> ExecuteResult:
        """The session path for an already-derived ``rt_…`` id.

        ``request``'s input refs must already be scoped (``execute`` does it).
        ``answer`` and ``turn_key`` as for ``execute``.
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
            keyed = _Keyed(
                turn_key,
                # Saved as its answer says once committed: durable.
                encode=lambda result: msgspec.json.encode(
                    msgspec.structs.replace(result, durable=True)
                ),
                decode=lambda body: msgspec.json.decode(body, type=ExecuteResult),
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
        keyed: _Keyed[_T] | None = None,
    ) -> tuple[_T, bool]:
        """One turn in a session: hold, attach (restore first), egress, inputs, ``work``,
        checkpoint unless ``changed`` says the workspace is as it was, touch. With
        ``work``'s result: whether the turn is durable (in a checkpoint). ``answer``:
        the turn's idempotent answer for (result, durable), stored by its commit;
        ``keyed``: its result saved with its checkpoint, and found there by a retry."""
        with self.metrics.timer("sandcell_turn_duration_seconds"):
            return await self._held_turn(
                session_id,
                request,
                work,
                changed=changed,
                egress=egress,
                verify=verify,
                answer=answer,
                keyed=keyed,
            )

    async def _held_turn(
        self,
        session_id: str,
        request: ExecuteRequest,
        work: Callable[[SandboxHandle], Awaitable[_T]],
        *,
        changed: Callable[[_T], bool | None],
        egress: EgressPolicy | None,
        verify: bool,
        answer: Callable[[_T, bool], IdempotentAnswer | None] | None,
        keyed: _Keyed[_T] | None = None,
    ) -> tuple[_T, bool]:
        manager = self.manager
        spec = self._spec_for(egress)
        async with manager.hold(session_id, wait_ms=self.session_wait_ms) as hold:
            attached = await manager.attach(hold, spec, verify=verify)
            if keyed is not None and answer is not None:
                applied = await self._found_applied(hold, keyed, answer)
                if applied is not None:
                    return applied, True
            try:
                await manager.open_turn(hold)
                if egress is not None and not attached.launched:
                    # A sandbox launched for this turn got it already; a kept one now.
                    await manager.apply_egress(attached.handle, egress)
                await deliver_inputs(
                    attached.handle, request, session_id=session_id, source=self.inputs
                )
                result = await work(attached.handle)
                await manager.count_egress(attached.handle)
            except asyncio.CancelledError:
                # Interrupted (Ctrl-C, SIGTERM, a client that left, a lost lock): the
                # job stopped when its stream closed. The rule for an interrupted turn
                # is a timeout's: the session keeps what the job wrote until then. Not
                # for a keyed turn: its client retries it, and the retry must not find
                # half of it applied (exactly once), so it goes back to the last commit.
                if answer is None:
                    await manager.sandboxes.shielded(self._keep_interrupted(hold, attached))
                else:
                    await manager.sandboxes.shielded(manager.recycle(hold, attached))
                raise
            except (LockLostError, SandboxUnavailableError, SandboxTimeoutError):
                # Lost the lock, unreachable, or timed out while the job may still
                # run: the sandbox may be dirty, so it is recycled, never reused.
                await manager.recycle(hold, attached)
                raise
            except SandcellError:
                # Refused before or by the runner (a bad input, a missing file): the
                # job did not run, so the sandbox holds nothing uncommitted.
                with contextlib.suppress(SandcellError):
                    await manager.close_turn(hold)
                raise
            # A fresh sandbox that restored nothing and received no inputs holds only
            # what the job made: if it changed nothing, there is nothing to save.
            pristine = (
                attached.launched
                and not attached.restored
                and not request.files
                and not request.inline_files
            )
            # A sandbox whose last checkpoint failed (on any worker: the mark is in
            # the record) holds an unsaved turn: save it now even if this turn
            # changed nothing.
            unsaved = hold.record is not None and hold.record.unsaved

            def answer_of(durable: bool) -> IdempotentAnswer | None:
                return None if answer is None else answer(result, durable)

            saved = None if keyed is None else TurnResult(keyed.turn_key, keyed.encode(result))

            durable = True
            if (
                changed(result) is False
                and (hold.checkpoint_key is not None or pristine)
                and not unsaved
            ):
                self.metrics.inc("sandcell_checkpoints_total", outcome="unchanged")
                await manager.close_turn(hold, answer=answer_of(True))
            else:
                durable = await self._checkpoint_retrying(
                    hold, attached, answer_of, turn_result=saved
                )
            await manager.touch(session_id)
            if not self.keep_warm:
                await manager.park(hold, attached)
        return result, durable

    async def _found_applied(
        self,
        hold: Hold,
        keyed: _Keyed[_T],
        answer: Callable[[_T, bool], IdempotentAnswer | None],
    ) -> _T | None:
        """The result of ``keyed``'s first run, if the checkpoint just restored is the one
        it wrote (the registry forgot the session, and with it the turn's answer, or the
        turn's record write never happened): the turn is applied there, so it is
        committed now (the record points at that checkpoint) with that answer, and not
        run again. None: run the turn."""
        manager = self.manager
        found = manager.applied_turn(hold)
        if found is None or found.turn_key != keyed.turn_key:
            return None
        try:
            body = await manager.persistence.turn_result(found)
        except CheckpointError as exc:
            raise SandboxUnavailableError(
                f"cannot read the turn's saved result ({type(exc).__name__}); retry"
            ) from exc
        if body is None:
            return None
        result = keyed.decode(body)
        await manager.commit_answer(hold, answer(result, True))
        self.metrics.inc("sandcell_turns_found_applied_total")
        log.info("session %s: a keyed turn's retry found it applied", hold.session_id[:11])
        await manager.touch(hold.session_id)
        return result

    async def _checkpoint_retrying(
        self,
        hold: Hold,
        attached: Attached,
        answer_of: Callable[[bool], IdempotentAnswer | None],
        *,
        turn_result: TurnResult | None = None,
    ) -> bool:
        """Checkpoint, retrying store and transport failures for ``checkpoint_retry_s``;
        whether it was saved. The write that commits the turn (saved, or marked
        unsaved) stores ``answer_of(durable)`` with it.

        A turn acknowledged on a failed checkpoint lives only in its warm sandbox,
        so a short outage (S3 restarting) is waited out under the session lock,
        which is renewed meanwhile. Past the budget the previous checkpoint is kept
        (rule 6) and the record marks the sandbox unsaved. A runner that no longer
        answers is not retried (what it held is gone), nor is a lost lock or a
        fenced write: another holder owns the session.
        """
        deadline = time.monotonic() + self.checkpoint_retry_s
        delay = 0.2
        while True:
            try:
                await self.manager.checkpoint(
                    hold, attached, answer=answer_of(True), turn_result=turn_result
                )
            except LockLostError:
                raise
            except (CheckpointError, SandboxError, TimeoutError) as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await self._runner_answers(attached):
                    await self._checkpoint_failed(hold, exc, answer_of(False))
                    return False
                self.metrics.inc("sandcell_checkpoint_retries_total")
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 2.0)
            except (SessionBusyError, SessionConflictError) as exc:
                await self._checkpoint_failed(hold, exc, answer_of(False))
                return False
            else:
                return True

    async def _runner_answers(self, attached: Attached) -> bool:
        """Whether the sandbox's runner still answers ``/health`` (a retry can save it)."""
        try:
            async with asyncio.timeout(self.manager.budgets.health_s):
                await attached.handle.runner.health()
        except (SandboxError, TimeoutError):
            return False
        return True

    async def _checkpoint_failed(
        self, hold: Hold, exc: Exception, answer: IdempotentAnswer | None
    ) -> None:
        log.warning(
            "session %s: checkpoint failed (%s); keeping the previous one",
            hold.session_id[:11],
            type(exc).__name__,
        )
        try:
            await self.manager.close_turn(hold, unsaved=True, answer=answer)
        except SandcellError as mark_exc:
            # Lost lock or registry down: the next holder cannot know; the answer
            # still says the turn is not durable.
            log.warning(
                "session %s: could not mark it unsaved (%s)",
                hold.session_id[:11],
                type(mark_exc).__name__,
            )

    async def _keep_interrupted(self, hold: Hold, attached: Attached) -> None:
        """Checkpoint an interrupted turn's workspace; recycle the sandbox if that fails.

        The runner's checkpoint waits (briefly) for the stopped job's cleanup, so a
        job that did not stop makes it fail, and the session then falls back to its
        last checkpoint: a dirty sandbox is never saved or reused.
        """
        manager = self.manager
        self.metrics.inc("sandcell_interrupted_turns_total")
        try:
            await manager.checkpoint(hold, attached)
        except Exception as exc:
            log.warning(
                "session %s: interrupted turn not saved (%s); back to its last checkpoint",
                hold.session_id[:11],
                type(exc).__name__,
            )
            await manager.recycle(hold, attached)
            return
        await manager.touch(hold.session_id)
        if not self.keep_warm:
            await manager.park(hold, attached)

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
