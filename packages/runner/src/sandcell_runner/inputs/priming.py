"""Priming: the only writer of inputs into a workspace, reading from the input cache.

Pushed inputs land in the input cache (outside every workspace and jail mount);
priming copies them to their names in the workspace before a job runs. In a
session it deduplicates by identity (storage_session, object_id, name): a writable
input the sandbox has since edited is kept (its edit wins over re-delivery of the
same ref), a different ref at that path replaces it, and a read-only input is
root-owned, mode 0444, and restored to its pristine bytes before every execute.
"""

from __future__ import annotations

import asyncio
import os

from sandcell_protocol import FileRef, PrimedInput, SurfacedOutput

from ..workspace import fsops
from ..workspace.manager import JobWorkspace
from .cache import CachedObject, InputCache


class Primer:
    """Copies cached input objects into workspaces."""

    def __init__(self, cache: InputCache) -> None:
        self._cache = cache

    async def prime(
        self,
        refs: list[FileRef],
        workspace: JobWorkspace,
        *,
        primed: dict[str, PrimedInput] | None = None,
    ) -> int:
        """Prime ``refs`` (validated names) into ``workspace``; returns how many were copied.

        ``primed`` is the session's record of earlier priming (None for a fresh job).
        """
        copied = 0
        for ref in refs:
            previous = primed.get(ref.name) if primed is not None else None
            same = previous is not None and (
                previous.storage_session,
                previous.object_id,
                previous.read_only,
            ) == (ref.storage_session, ref.object_id, ref.read_only)
            if same and previous is not None:
                if not ref.read_only:
                    continue  # the sandbox's own edits win over re-delivery
                current = await asyncio.to_thread(fsops.file_digest, workspace.path, ref.name)
                pristine_owner = 0 if os.geteuid() == 0 else workspace.uid
                if (
                    current is not None
                    and current[1] == previous.sha256
                    and current[0].st_uid == pristine_owner
                ):
                    continue
            cached = await self._cache.resolve(ref)
            await asyncio.to_thread(self._copy, ref, cached, workspace)
            copied += 1
            if primed is not None:
                primed[ref.name] = PrimedInput(
                    storage_session=ref.storage_session,
                    object_id=ref.object_id,
                    name=ref.name,
                    read_only=ref.read_only,
                    sha256=cached.sha256,
                )
        return copied

    def _copy(self, ref: FileRef, cached: CachedObject, workspace: JobWorkspace) -> None:
        # Root-owned where the runner is root, so the job cannot change the bytes in
        # place; unprivileged runners can only make the file read-only.
        owner = 0 if ref.read_only and os.geteuid() == 0 else workspace.uid
        st = fsops.copy_into(
            workspace.path,
            ref.name,
            cached.path,
            mode=0o444 if ref.read_only else 0o644,
            uid=owner,
            gid=owner if owner == 0 else workspace.gid,
            dir_uid=workspace.uid,
            dir_gid=workspace.gid,
        )
        # An input is not an output: only a later change by the job surfaces it.
        workspace.surfaced[ref.name] = SurfacedOutput(
            name=ref.name, size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=cached.sha256
        )
