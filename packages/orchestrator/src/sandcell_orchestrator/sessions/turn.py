"""``SessionTurns``: one turn in a runtime session, from hold to commit.

Hold the session, attach its sandbox (reuse the warm one, or launch one and
restore the last checkpoint before anything runs), apply the turn's egress, push
missing inputs, run the work, then commit: checkpoint (fenced, retried through a
short store outage) or close the turn unchanged, touch, and park the sandbox when
sessions are not kept warm. ``ExecutionService`` gives it the work (a job, a code
context's cell) and its settings.

Fail closed on state, open on speed: a failed checkpoint keeps the previous one
(the record marks the sandbox unsaved); a lost lock aborts the work in flight; a
sandbox that may be dirty is recycled, not reused. An interrupted turn keeps what
its job wrote, unless it is a keyed one (exactly once): that goes back to the last
commit, so its retry never finds half of it applied. A keyed turn's result is
saved with its checkpoint, and once committed by its key alone, so a retry after
the registry forgot the turn (a wiped Redis) finds it applied instead of running
it again, whichever checkpoint it restored, also for a turn that changed nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from sandcell_protocol import EgressPolicy, ExecuteRequest

from ..errors import (
    CheckpointError,
    LockLostError,
    SandboxError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SandcellError,
    SessionBusyError,
    SessionConflictError,
)
from ..handle import SandboxHandle
from ..providers.base import SandboxSpec
from ..registry import IdempotentAnswer
from .inputs import InputSource, deliver_inputs
from .manager import Attached, Hold, SandboxManager
from .persistence import TurnResult

__all__ = ["TRACE_KEY_CHARS", "Keyed", "SessionTurns", "TurnSettings", "trace_tag"]

log = logging.getLogger(__name__)

TRACE_KEY_CHARS = 12
"""How much of a keyed turn's stored key its trace lines show (``trace_tag``)."""


def trace_tag(turn_key: str | None) -> str:
    """A turn's name in its DEBUG trace lines: the first ``TRACE_KEY_CHARS`` hex digits
    of its stored idempotency key, "-" for a turn without one.

    The stored key is already a SHA-256 of (surface, tenant, the client's header)
    (``Idempotency.scoped``), so the client's key, which a client may treat as a
    secret, never shows; a prefix, not the whole storage key, keeps the log from
    naming the registry entry outright, yet still finds the turn's ``answer/``
    objects in the store, and a client that knows its header recomputes the tag."""
    return "-" if turn_key is None else turn_key[:TRACE_KEY_CHARS]


def _checkpoint_name(key: str | None) -> str:
    """A checkpoint key without its session prefix (the session is on the line)."""
    return "-" if key is None else key.rpartition("/")[2]


def _trace(tag: str, step: str, session_id: str, **fields: object) -> None:
    """One DEBUG line of a turn's steps: ``turn <tag> <step> session=… k=v …``.

    Only ids, flags and generations: never code, output, tokens or keys."""
    if log.isEnabledFor(logging.DEBUG):
        shown = " ".join(f"{name}={value}" for name, value in fields.items())
        log.debug("turn %s %s session=%s %s", tag, step, session_id[:11], shown)


_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Keyed(Generic[_T]):
    """A keyed turn's stored idempotency key, and how its result is saved with its
    checkpoint and read back (``Persistence.save_turn_result``)."""

    turn_key: str
    encode: Callable[[_T], bytes]
    decode: Callable[[bytes], _T]


class TurnSettings(Protocol):
    """What a turn reads of its service's settings, at the time it runs."""

    @property
    def inputs(self) -> InputSource | None:
        """Where pushed input refs are read from."""

    @property
    def keep_warm(self) -> bool:
        """False: park each session's sandbox at the end of its turn."""

    @property
    def checkpoint_retry_s(self) -> float:
        """How long a turn retries a failed checkpoint before keeping the previous one."""

    @property
    def session_wait_ms(self) -> int:
        """How long a turn waits for a busy session before ``SessionBusyError``."""


class SessionTurns:
    """Runs turns in sessions of ``manager``, as ``settings`` say at each turn."""

    def __init__(self, manager: SandboxManager, settings: TurnSettings) -> None:
        self.manager = manager
        self.settings = settings
        self.metrics = manager.metrics

    async def run(
        self,
        session_id: str,
        request: ExecuteRequest,
        work: Callable[[SandboxHandle], Awaitable[_T]],
        *,
        spec: SandboxSpec,
        changed: Callable[[_T], bool | None],
        egress: EgressPolicy | None,
        verify: bool,
        answer: Callable[[_T, bool], IdempotentAnswer | None] | None,
        keyed: Keyed[_T] | None = None,
    ) -> tuple[_T, bool]:
        """One turn in a session, held: attach (``spec``'s sandbox, restored first),
        egress, inputs, ``work``, then commit: checkpoint unless ``changed`` says the
        workspace is as it was. With ``work``'s result: whether the turn is durable (in
        a checkpoint). ``answer``: the turn's idempotent answer for (result, durable),
        stored by its commit; with one, an interrupted turn keeps none of its writes.
        ``keyed``: its result saved with its checkpoint, and found there by a retry;
        once committed, also by its key alone (after the hold: the session is free
        for its next turn meanwhile, and the turn is committed either way)."""
        result, durable, committed = await self._held(
            session_id,
            request,
            work,
            spec=spec,
            changed=changed,
            egress=egress,
            verify=verify,
            answer=answer,
            keyed=keyed,
        )
        if committed is not None:
            await self.manager.save_answer(session_id, committed.turn_key, committed.body)
        return result, durable

    async def _held(
        self,
        session_id: str,
        request: ExecuteRequest,
        work: Callable[[SandboxHandle], Awaitable[_T]],
        *,
        spec: SandboxSpec,
        changed: Callable[[_T], bool | None],
        egress: EgressPolicy | None,
        verify: bool,
        answer: Callable[[_T, bool], IdempotentAnswer | None] | None,
        keyed: Keyed[_T] | None,
    ) -> tuple[_T, bool, TurnResult | None]:
        """``run``'s turn under the hold; with a keyed turn's result to keep by key."""
        manager = self.manager
        settings = self.settings
        tag = trace_tag(None if keyed is None else keyed.turn_key)
        async with manager.hold(session_id, wait_ms=settings.session_wait_ms) as hold:
            # Judged by the record the hold found, before attach: a launch records its
            # sandbox (a session without a record has one after it), and a launch and
            # restore can outlast the young-record window.
            forgot = manager.may_have_forgotten(hold)
            record = hold.record
            _trace(
                tag,
                "held",
                session_id,
                generation=hold.generation,
                record=record is not None,
                adopted=record is not None and record.adopted,
                turn_open=record is not None and record.turn_open,
                unsaved=record is not None and record.unsaved,
                forgot=forgot,
                checkpoint=_checkpoint_name(hold.checkpoint_key),
            )
            attached = await manager.attach(hold, spec, verify=verify)
            _trace(
                tag,
                "attached",
                session_id,
                launched=attached.launched,
                restored=attached.restored,
                checkpoint=_checkpoint_name(hold.checkpoint_key),
                sandbox=attached.handle.sandbox_id,
            )
            # A restored checkpoint is asked too, whatever the record's age: a record a
            # retry made after a wipe (its restore then failed) ages past the window
            # during a long outage, still pointing at the turn's own checkpoint. Beside
            # a restore, two small reads cost little; a warm turn reads nothing.
            if keyed is not None and answer is not None and (forgot or attached.restored):
                applied = await self._found_applied(hold, keyed, answer)
                _trace(tag, "applied-check", session_id, found=applied is not None)
                if applied is not None:
                    # Kept by key too (it may have been found only by its checkpoint).
                    return applied, True, TurnResult(keyed.turn_key, keyed.encode(applied))
            try:
                await manager.open_turn(hold)
                if egress is not None and not attached.launched:
                    # A sandbox launched for this turn got it already; a kept one now.
                    await manager.apply_egress(attached.handle, egress)
                await deliver_inputs(
                    attached.handle, request, session_id=session_id, source=settings.inputs
                )
                result = await work(attached.handle)
                await manager.count_egress(attached.handle)
            except asyncio.CancelledError:
                # Interrupted (Ctrl-C, SIGTERM, a client that left, a lost lock): the
                # job stopped when its stream closed. The rule for an interrupted turn
                # is a timeout's: the session keeps what the job wrote until then. Not
                # for a keyed turn: its client retries it, and the retry must not find
                # half of it applied (exactly once), so it goes back to the last commit.
                _trace(tag, "interrupted", session_id, keep=answer is None)
                if answer is None:
                    await manager.sandboxes.shielded(self._keep_interrupted(hold, attached))
                else:
                    await manager.sandboxes.shielded(manager.recycle(hold, attached))
                raise
            except (LockLostError, SandboxUnavailableError, SandboxTimeoutError) as exc:
                # Lost the lock, unreachable, or timed out while the job may still
                # run: the sandbox may be dirty, so it is recycled, never reused.
                _trace(tag, "recycled", session_id, error=type(exc).__name__)
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
            unchanged = (
                changed(result) is False
                and (hold.checkpoint_key is not None or pristine)
                and not unsaved
            )
            if unchanged:
                self.metrics.inc("sandcell_checkpoints_total", outcome="unchanged")
                await manager.close_turn(hold, answer=answer_of(True))
            else:
                durable = await self._checkpoint_retrying(
                    hold, attached, answer_of, turn_result=saved
                )
            _trace(
                tag,
                "committed",
                session_id,
                durable=durable,
                unchanged=unchanged,
                generation=hold.generation,
                checkpoint=_checkpoint_name(hold.checkpoint_key),
            )
            # Committed: by its key, the store says so whatever checkpoint a retry
            # restores (a not durable turn is in no checkpoint: nothing to find).
            committed = saved if answer is not None and durable else None
            await manager.touch(session_id)
            if not self.settings.keep_warm:
                await manager.park(hold, attached)
        return result, durable, committed

    async def _found_applied(
        self,
        hold: Hold,
        keyed: Keyed[_T],
        answer: Callable[[_T, bool], IdempotentAnswer | None],
    ) -> _T | None:
        """The result of ``keyed``'s first run, if the store says it is applied in the
        held session (the registry forgot the session, and with it the turn's answer,
        or the turn's record write never happened): the checkpoint just restored is
        the one it wrote, or its answer was saved by key once it committed. It is
        committed now (the record points at what was restored) with that answer, and
        not run again. None: run the turn. A store that cannot say fails the turn
        (retryable): running it might run it twice."""
        manager = self.manager
        try:
            body = await manager.saved_answer(hold, keyed.turn_key)
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
        deadline = time.monotonic() + self.settings.checkpoint_retry_s
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
        if not self.settings.keep_warm:
            await manager.park(hold, attached)
