"""The workspaces jobs run in, and the job directories in use.

``fresh`` gives a one-shot job its own workspace and UID (removed, and the UID
released, after the answer has gone out); ``session`` gives a session job the bound
session's workspace and pinned UID under the session lock, with a job directory of
its own. The directories of running jobs are counted (``keep_paths``, ``busy``) so
the reaper never removes one and the idle exit waits for them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from ..cancelling import to_thread_to_the_end
from ..jail.uidpool import UidPool
from .manager import JobDirs, JobWorkspace, WorkspaceManager
from .session import SessionManager

__all__ = ["JobWorkspaces"]

log = logging.getLogger(__name__)


class JobWorkspaces:
    """Job workspaces on ``workspaces``: fresh ones with UIDs from ``uids``, and the
    bound session's (``sessions``)."""

    def __init__(
        self, workspaces: WorkspaceManager, uids: UidPool, sessions: SessionManager
    ) -> None:
        self._workspaces = workspaces
        self._uids = uids
        self.sessions = sessions
        self._active: collections.Counter[Path] = collections.Counter()
        """Directories of running jobs, counted: a one-shot job's ``jobs/<id>`` is
        reused, so the next job may take it before this one's removal is over."""
        self._cleanups: set[asyncio.Task[None]] = set()

    def keep_paths(self) -> set[Path]:
        """The job directories in use (the reaper leaves them)."""
        return set(self._active)

    def busy(self) -> bool:
        """Whether a job runs in one of them."""
        return bool(self._active)

    async def drain(self) -> None:
        """Wait for the removals still running (at shutdown)."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def fresh(
        self, fill: Callable[[JobWorkspace], None] | None = None, *, small: bool = False
    ) -> AsyncIterator[JobWorkspace]:
        """A fresh per-job workspace and UID, removed and released afterwards.

        ``fill`` (blocking) writes into it in the same thread hop that creates it.
        ``small``: ``fill`` writes little (a few KiB), so when the pools have a job
        directory and an image ready, both happen on the event loop, without the
        hop (``WorkspaceManager.create_job_now`` says what it saves).
        """
        uid = self._uids.allocate()
        made: list[JobDirs] = []

        def create(ready: JobDirs | None = None) -> JobWorkspace:
            dirs = ready or self._workspaces.create_job(uid=uid, gid=uid)
            made.append(dirs)
            workspace = JobWorkspace(path=dirs.workspace, uid=uid, gid=uid, job_dir=dirs.job_dir)
            if fill is not None:
                fill(workspace)
            return workspace

        dirs: JobDirs | None = None
        try:
            try:
                ready = self._workspaces.create_job_now(uid=uid, gid=uid) if small else None
                if ready is not None:
                    workspace = create(ready)
                else:
                    # To its end: cancelled in the thread, the workspace it still made
                    # was left, its UID back in the pool while files it owns were written.
                    workspace = await to_thread_to_the_end(create)
            finally:
                dirs = made[0] if made else None
                if dirs is not None:
                    self._active[dirs.base] += 1
            yield workspace
        finally:
            # Removal runs after the answer has gone out: it is off the latency path,
            # and the UID returns to the pool only once its files are gone.
            cleanup = asyncio.create_task(self._remove_fresh(dirs, uid))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)

    def _job_done(self, path: Path) -> None:
        self._active[path] -= 1
        if self._active[path] <= 0:
            del self._active[path]

    async def _remove_fresh(self, dirs: JobDirs | None, uid: int) -> None:
        try:
            if dirs is not None and not self._workspaces.remove_job_now(dirs):
                await asyncio.to_thread(self._workspaces.remove_job, dirs)
        except OSError as exc:
            log.warning("fresh workspace not removed (the reaper will retry): %s", exc)
        finally:
            # Done even when the removal failed: a directory still counted here is one
            # the reaper never retries and the idle exit waits on for ever.
            if dirs is not None:
                self._job_done(dirs.base)
            self._uids.release(uid)

    @contextlib.asynccontextmanager
    async def session(
        self, session_id: str, fill: Callable[[JobWorkspace], None] | None = None
    ) -> AsyncIterator[JobWorkspace]:
        """The bound session's workspace and pinned UID, holding the session lock.

        ``fill`` (blocking) writes into it in the same thread hop that makes the job directory,
        the turn's entry file first (``Executor.write_inputs``): so such a turn may take a
        finished turn's job directory (``create_session_job_dir``), and its job must be
        over (``Jail.run``) when this exits.
        """
        async with self.sessions.locked(session_id) as state:
            made: list[Path] = []
            # A turn that writes its entry file (``fill``) may take a kept directory.
            reuse = fill is not None
            remove = (
                self._workspaces.remove_session_job_dir if reuse else self._workspaces.remove_dir
            )

            def create() -> JobWorkspace:
                job_dir = self._workspaces.create_session_job_dir(reuse=reuse)
                made.append(job_dir)
                workspace = JobWorkspace(
                    path=state.workspace,
                    uid=state.uid,
                    gid=state.uid,
                    job_dir=job_dir,
                    surfaced=state.surfaced,
                    session_id=session_id,
                )
                if fill is not None:
                    fill(workspace)
                return workspace

            try:
                # To its end: cancelled in the thread, the job directory it still made
                # was left, and the session lock went while it wrote the entry file.
                workspace = await to_thread_to_the_end(create)
            except BaseException:
                for job_dir in made:
                    await to_thread_to_the_end(
                        functools.partial(self._workspaces.remove_dir, job_dir)
                    )
                raise
            job_dir = made[0]
            self._active[job_dir] += 1
            try:
                yield workspace
            finally:
                try:
                    await to_thread_to_the_end(functools.partial(remove, job_dir))
                finally:
                    self._job_done(job_dir)  # as in ``_remove_fresh``: a failed removal too
