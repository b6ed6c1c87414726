"""Session binding: one workspace and one pinned UID kept across a runtime session's calls.

A runner is bound to at most one session, on the first request that names one
(``X-Runtime-Session-Id``). Calls in the session are serialized by one lock that
executions, checkpoints, restores and file operations all take, so a checkpoint
never sees a half-run job and a restore never swaps a workspace under one.

A bound session also gets its own network namespace (when the runner can make
one), which every job of the session joins; release runs the release hooks (the
app layer stops the session's processes) before the workspace is wiped, and
closes the namespace last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandcell_protocol import (
    PROTOCOL_VERSION,
    CheckpointMeta,
    PrimedInput,
    SurfacedOutput,
    is_runtime_session_id,
)

from ..cancelling import to_thread_to_the_end
from ..errors import (
    BadRequestError,
    NotFoundError,
    QuarantinedError,
    SessionBusyError,
    SessionConflictError,
)
from ..jail.netns import SessionNetns
from ..jail.uidpool import UidPool
from .manager import WorkspaceManager

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SessionState:
    """The bound session: its workspace, pinned UID, and what the runner knows of its files."""

    session_id: str
    uid: int
    workspace: Path
    generation: int = 0
    surfaced: dict[str, SurfacedOutput] = field(default_factory=dict)
    primed: dict[str, PrimedInput] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    staging: set[Path] = field(default_factory=set)
    retiring: dict[Path, asyncio.Task[None]] = field(default_factory=dict)
    """Workspaces a restore replaced, still being removed."""
    netns: SessionNetns | None = None
    """The session's network namespace (None: each job gets a fresh one)."""
    contexts: dict[str, str] = field(default_factory=dict)
    """The session's code contexts (id -> language), live or lost: checkpointed, so
    a restore elsewhere knows which contexts it did not bring back."""

    def metadata(self) -> CheckpointMeta:
        """Checkpoint metadata of the current state (``skipped`` is filled by export)."""
        return CheckpointMeta(
            session_id=self.session_id,
            protocol=PROTOCOL_VERSION,
            primed_inputs=sorted(self.primed.values(), key=lambda p: p.name),
            surfaced_outputs=sorted(self.surfaced.values(), key=lambda s: s.name),
            contexts=dict(sorted(self.contexts.items())),
        )

    def adopt(self, meta: CheckpointMeta) -> None:
        """Restored metadata replaces the runner's own (never merges)."""
        self.primed = {p.name: p for p in meta.primed_inputs}
        self.surfaced = {s.name: s for s in meta.surfaced_outputs}
        self.contexts = dict(meta.contexts)


class SessionManager:
    """Holds the (at most one) bound session of this runner."""

    def __init__(
        self,
        *,
        enabled: bool,
        workspaces: WorkspaceManager,
        uids: UidPool,
        wait_ms: int,
        netns_factory: Callable[[], SessionNetns | None] | None = None,
    ) -> None:
        self.enabled = enabled
        self._netns_factory = netns_factory
        self.release_hooks: list[Callable[[SessionState], Awaitable[None]]] = []
        """Run under the session lock before the workspace is wiped."""
        self._workspaces = workspaces
        self._uids = uids
        self._wait_s = wait_ms / 1000
        self._bind_lock = asyncio.Lock()
        self.bound: SessionState | None = None
        self.quarantined = False
        self.quarantine_reason = ""

    # -- checks -----------------------------------------------------------------

    def require_enabled(self) -> None:
        """Session routes do not exist on a stateless image."""
        if not self.enabled:
            raise NotFoundError("sessions are not enabled on this runner")

    def check_header(self, session_id: str | None) -> str | None:
        """Validate an ``X-Runtime-Session-Id`` value (None when absent)."""
        if session_id is None:
            return None
        if not self.enabled:
            raise BadRequestError("X-Runtime-Session-Id refused: sessions are not enabled")
        if not is_runtime_session_id(session_id):
            raise BadRequestError("X-Runtime-Session-Id must match ^rt_[0-9a-f]{64}$")
        return session_id

    def require_not_quarantined(self) -> None:
        if self.quarantined:
            raise QuarantinedError(
                "runner quarantined after a failed workspace wipe; recycle this sandbox"
            )

    # -- binding ----------------------------------------------------------------

    async def bind(self, session_id: str) -> SessionState:
        """The session's state, binding the runner to it on first use."""
        self.require_not_quarantined()
        async with self._bind_lock:
            if self.bound is not None:
                if self.bound.session_id != session_id:
                    raise SessionConflictError(
                        "runner is bound to another runtime session; use a different sandbox"
                    )
                return self.bound
            uid = self._uids.allocate()
            path = self._workspaces.session / "ws-0"
            netns = None
            try:
                # To their ends: a thread still making the workspace, or the namespace,
                # after the UID went back would leave them owned by the next session's.
                await to_thread_to_the_end(lambda: self._fresh_dir(path, uid))
                if self._netns_factory is not None:
                    netns = await to_thread_to_the_end(self._netns_factory, undo=_close)
            except BaseException:
                self._uids.release(uid)
                raise
            self.bound = SessionState(session_id=session_id, uid=uid, workspace=path, netns=netns)
            log.info("bound to runtime session %s (uid %d)", session_id[:11], uid)
            return self.bound

    def _fresh_dir(self, path: Path, uid: int) -> None:
        if path.exists():
            self._workspaces.remove_workspace(path)
        self._workspaces.make_workspace(path, uid=uid, gid=uid)

    @contextlib.asynccontextmanager
    async def locked(self, session_id: str) -> AsyncIterator[SessionState]:
        """Bind, then hold the session lock; waits a short bound, then ``SessionBusyError``."""
        state = await self.bind(session_id)
        try:
            async with asyncio.timeout(self._wait_s):
                await state.lock.acquire()
        except TimeoutError:
            raise SessionBusyError("another call in this session is running; retry") from None
        try:
            if self.bound is not state:
                raise SessionConflictError("session was released while waiting")
            yield state
        finally:
            state.lock.release()

    # -- restore support ----------------------------------------------------------

    async def new_staging(self, state: SessionState) -> Path:
        """An empty, private directory beside the workspace for a restore to extract into."""
        state.generation += 1
        # Named like a workspace from the start: a mount point cannot be renamed
        # (EBUSY), so the swap is a pointer change, not a rename.
        path = self._workspaces.session / f"ws-{state.generation}"
        state.staging.add(path)
        await asyncio.to_thread(self._fresh_dir, path, state.uid)
        return path

    async def swap_in(self, state: SessionState, staging: Path) -> None:
        """Make a fully extracted staging directory the workspace (caller holds the lock).

        The old workspace is removed in the background: its unmounts wait for the
        kernel (50-250 ms, a few CPU-ms), which the restore's answer need not. No
        job sees it any more; ``release`` waits for the removal before the UID
        that owns its files can go to another session.
        """
        old = state.workspace
        state.workspace = staging
        state.staging.discard(staging)
        task = asyncio.get_running_loop().create_task(self._retire(old))
        state.retiring[old] = task
        task.add_done_callback(lambda _: state.retiring.pop(old, None))

    async def _retire(self, old: Path) -> None:
        try:
            await asyncio.to_thread(self._workspaces.remove_workspace, old)
        except OSError as exc:
            log.warning("old session workspace %s not removed: %s", old, exc)

    async def discard_staging(self, state: SessionState, staging: Path) -> None:
        state.staging.discard(staging)
        try:
            await asyncio.to_thread(self._workspaces.remove_workspace, staging)
        except OSError as exc:
            log.warning("restore staging %s not removed: %s", staging, exc)

    # -- release ----------------------------------------------------------------

    async def release(self, session_id: str | None) -> None:
        """Wipe the workspace and release the UID; a failed wipe quarantines the runner."""
        async with self._bind_lock:
            state = self.bound
            if state is None:
                return
            if session_id is not None and session_id != state.session_id:
                raise SessionConflictError("runner is bound to another runtime session")
            try:
                async with asyncio.timeout(self._wait_s):
                    await state.lock.acquire()
            except TimeoutError:
                raise SessionBusyError("a call in this session is running; retry") from None
            try:
                for hook in self.release_hooks:
                    await hook(state)
                if state.retiring:
                    await asyncio.gather(*state.retiring.values())
                for path in (state.workspace, *state.staging):
                    await asyncio.to_thread(self._workspaces.remove_workspace, path)
            except OSError as exc:
                # Keep the UID: files it owns may remain, and handing it to another job
                # would give that job access to them.
                self.quarantined = True
                self.quarantine_reason = f"workspace wipe failed: {exc.strerror or exc}"
                log.exception("quarantined: %s", self.quarantine_reason)
                _close_netns(state)
                raise QuarantinedError("workspace wipe failed; runner quarantined") from None
            finally:
                state.lock.release()
            _close_netns(state)
            self._uids.release(state.uid)
            self.bound = None
            log.info("released runtime session %s", state.session_id[:11])

    def netns_fd_for(self, workspace: Path) -> int | None:
        """The namespace fd jobs in ``workspace`` join: the bound session's, for its workspace."""
        state = self.bound
        if state is None or state.netns is None or state.netns.closed:
            return None
        return state.netns.fd if workspace == state.workspace else None

    def keep_paths(self) -> set[Path]:
        """What the reaper must never touch."""
        if self.bound is None:
            return set()
        return {self.bound.workspace, *self.bound.staging, *self.bound.retiring}


def _close(netns: SessionNetns | None) -> None:
    if netns is not None:
        netns.close()


def _close_netns(state: SessionState) -> None:
    if state.netns is not None:
        state.netns.close()
