"""Checkpoint and restore of the bound session's workspace, under the session lock.

Export streams the workspace while the lock is held (no job runs half-way through
a checkpoint). Restore extracts into a fresh staging directory and swaps it in
only once the whole archive was accepted and belongs to this session; on any
failure the workspace in place is left as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from sandcell_protocol import CheckpointMeta, RestoreResult

from ..errors import ArchiveRejectedError
from ..jail.cgroups import CgroupManager, JobCgroup
from ..workspace import fsops
from ..workspace.session import SessionManager, SessionState
from .compression import Encoding, sniff_encoding
from .export import ArchiveLimits, stream_checkpoint
from .extractor_process import ExtractorServer
from .restore import restore_checkpoint
from .selection import WorkspaceSelection

# Enough of the body to tell gzip from zstd by its magic bytes.
_SNIFF_BYTES = 4
# The extractor and its decompressing thread, with room for the interpreter's own.
_EXTRACTOR_PIDS = 16


class SessionCheckpoints:
    """The session's checkpoint stream out and its restore in."""

    def __init__(
        self,
        sessions: SessionManager,
        *,
        limits: ArchiveLimits,
        cgroups: CgroupManager | None = None,
        memory_bytes: int = 512 << 20,
    ) -> None:
        self._sessions = sessions
        self._limits = limits
        self._cgroups = cgroups if cgroups is not None and cgroups.available else None
        """The extractor runs in a cgroup of its own, limited like a job's."""
        self._memory_bytes = memory_bytes
        self.extractors = ExtractorServer()
        """Forks each restore's extractor (``start`` and ``aclose`` by the service)."""
        self.restore_hooks: list[Callable[[SessionState], Awaitable[None]]] = []
        """Run under the session lock once a restored workspace is in place."""

    async def export(
        self, session_id: str, *, encoding: Encoding, selection: WorkspaceSelection
    ) -> AsyncIterator[bytes]:
        """The checkpoint archive's chunks; the session stays locked until they are consumed.

        The first chunk is made before this returns: export's size checks fail
        here, so the caller answers a 4xx instead of a truncated 200. Close the
        iterator (``aclose``) if it is not read to its end.
        """
        stack = contextlib.AsyncExitStack()
        state: SessionState = await stack.enter_async_context(self._sessions.locked(session_id))
        try:
            chunks = stream_checkpoint(
                state.workspace,
                state.metadata(),
                encoding=encoding,
                limits=self._limits,
                selection=selection,
            )
            first = await anext(aiter(chunks), b"")
        except BaseException:
            await stack.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
                await stack.aclose()

        return body()

    async def _extract(
        self,
        chunks: AsyncIterator[bytes],
        staging: Path,
        state: SessionState,
        encoding: Encoding,
        expected_sha256: str | None,
    ) -> CheckpointMeta:
        cgroup = None
        if self._cgroups is not None:
            # One restore at a time per session (the lock): one pooled cgroup serves all.
            cgroup = await asyncio.to_thread(
                self._cgroups.acquire,
                "restore",
                memory_bytes=self._memory_bytes,
                pids=_EXTRACTOR_PIDS,
            )
        fds, threads, opened = self._join_fds(cgroup)
        try:
            return await restore_checkpoint(
                chunks,
                staging,
                uid=state.uid,
                gid=state.uid,
                encoding=encoding,
                limits=self._limits,
                expected_sha256=expected_sha256,
                cgroup_fds=fds,
                cgroup_fds_move_thread=threads,
                extractors=self.extractors,
            )
        finally:
            for fd in opened:
                os.close(fd)
            if cgroup is not None and cgroup.signal_leftovers():
                await asyncio.to_thread(cgroup.kill_all)

    @staticmethod
    def _join_fds(cgroup: JobCgroup | None) -> tuple[list[int], bool, list[int]]:
        """The files the extractor writes ``0`` into first; True if they move one thread;
        and which of them were opened for this restore (the caller closes those).

        On v1, ``tasks``: a single thread moving itself skips the kernel's global
        threadgroup lock, whose write side waits for an RCU grace period (measured
        here: 11-24 ms of every small restore's latency through ``cgroup.procs``).
        The extractor is single-threaded then (it checks), so the whole process moves.
        They are the pooled cgroup's, held open (``JobCgroup.join_fds``: two opens less).
        """
        if cgroup is None:
            return [], False, []
        held = cgroup.join_fds()
        if held is None:
            opened = cgroup.open_procs_fds()
            return opened, False, opened
        return held, True, []

    async def restore(
        self,
        session_id: str,
        body: AsyncIterator[bytes],
        *,
        expected_sha256: str | None,
        taken_of: str | None = None,
    ) -> RestoreResult:
        """Replace the session's workspace by the archive in ``body`` (gzip or zstd, sniffed).

        The archive must be the session's own, or, with ``taken_of`` (the caller says
        so: a copy of another session's workspace), that session's."""
        async with self._sessions.locked(session_id) as state:
            first = b""
            async for chunk in body:
                first += chunk
                if len(first) >= _SNIFF_BYTES:
                    break
            encoding = sniff_encoding(first)

            async def chunks() -> AsyncIterator[bytes]:
                yield first
                async for chunk in body:
                    yield chunk

            staging = await self._sessions.new_staging(state)
            try:
                meta = await self._extract(chunks(), staging, state, encoding, expected_sha256)
            except BaseException:
                await self._sessions.discard_staging(state, staging)
                raise
            if meta.session_id != (taken_of or session_id):
                await self._sessions.discard_staging(state, staging)
                raise ArchiveRejectedError("checkpoint belongs to another runtime session")
            await self._sessions.swap_in(state, staging)
            state.adopt(meta)
            for hook in self.restore_hooks:
                await hook(state)
            entries = await asyncio.to_thread(fsops.scan, state.workspace)
        files = [e for e in entries if e.kind == "file"]
        return RestoreResult(
            session_id=session_id, files=len(files), bytes=sum(e.size for e in files)
        )


__all__ = ["SessionCheckpoints"]
