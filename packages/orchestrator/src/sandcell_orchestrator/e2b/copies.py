"""``SandboxCopies``: E2B snapshots taken of running sandboxes, and forks made of them.

A snapshot is a copy of a running sandbox's workspace in the snapshot store, under an
id its tenant owns (``saved.SavedSnapshots``); the sandbox runs on, and its processes
are not in the copy. A create that names a snapshot as its template restores it
(``creation.SandboxCreation.create``). A fork is one snapshot, ``count`` creates
from it, then the snapshot deleted: each created sandbox, or each one's own error,
is its answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import anyio

from sandcell_protocol import EgressPolicy

from ..errors import SandcellError
from ..registry import E2bSandboxRow
from ..sessions.manager import SandboxManager
from .errors import UNSAVABLE, E2bError, unsavable
from .sandbox import E2bSandbox, new_sandbox_id
from .saved import SNAPSHOT_TAG, SavedSnapshots, SnapshotMeta
from .views import SandboxViews

__all__ = ["Creates", "SandboxCopies"]

log = logging.getLogger(__name__)


class Creates(Protocol):
    """``E2bSandboxes.create``, as a fork calls it."""

    def __call__(
        self,
        *,
        owner: str,
        template: str,
        timeout_s: int | None,
        metadata: Mapping[str, str],
        env: Mapping[str, str],
        auto_pause: bool,
        egress: EgressPolicy | None = None,
        public_traffic: bool = False,
        fork_of: E2bSandboxRow | None = None,
    ) -> Awaitable[E2bSandbox]: ...


class SandboxCopies:
    """Snapshots of a tenant's running sandboxes, and forks of them."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        views: SandboxViews,
        snapshots: SavedSnapshots,
        create: Creates,
        max_count: Callable[[], int],
        now: Callable[[], float],
    ) -> None:
        self._manager = manager
        self._views = views
        self._snapshots = snapshots
        self._create = create
        self._max_count = max_count
        self._now = now

    async def snapshot(
        self, sandbox: E2bSandbox, *, name: str | None = None, tag: str = SNAPSHOT_TAG
    ) -> SnapshotMeta:
        """Save a running sandbox's workspace as a new snapshot of its tenant's (the
        sandbox runs on; its processes are not in the snapshot), under ``name`` and
        ``tag`` if given (the older one under them deleted after); 404 when it is
        paused (as E2B, which snapshots only sandboxes live on a node), 429 past the
        tenant's cap (one under a taken name and tag too: the older goes after)."""
        await self._views.attach(sandbox)
        async with sandbox.lock:
            await self._views.refresh(sandbox)
            handle = sandbox.handle
            if sandbox.state != "running" or handle is None:
                raise E2bError(404, "not_found", f"sandbox {sandbox.sandbox_id} not found")
            owner = sandbox.owner
            # A place claimed before the copy: concurrent snapshots of the tenant's
            # other sandboxes count, so they cannot all take the last one.
            if not await self._snapshots.claim(owner):
                raise self._full()
            try:
                meta = SnapshotMeta(
                    snapshot_id=new_sandbox_id(),
                    namespace=owner,
                    template=sandbox.template,
                    sandbox_id=sandbox.sandbox_id,
                    session_id=sandbox.session_id,
                    created_at_s=self._now(),
                    name=name,
                    tag=tag,
                )
                key = self._snapshots.data_key(owner, meta.snapshot_id)
                try:
                    await self._manager.copy_workspace(sandbox.session_id, handle, key)
                except UNSAVABLE as exc:
                    # The tenant's own files: a 4xx naming why, not the store's 500.
                    most = self._manager.persistence.max_bytes
                    raise unsavable(
                        sandbox.sandbox_id, exc, what="a snapshot may be", most_bytes=most
                    ) from None
                if not await self._snapshots.add(meta):
                    raise self._full()
                await self._snapshots.supersede(meta)
            finally:
                self._snapshots.unclaim(owner)
        log.info("e2b sandbox %s: snapshot %s taken", sandbox.sandbox_id, meta.snapshot_id)
        return meta

    def _full(self) -> E2bError:
        return E2bError(
            429,
            "busy",
            f"at most {self._snapshots.max_per_tenant} snapshots per tenant; delete one first",
        )

    async def fork(
        self, sandbox: E2bSandbox, *, timeout_s: int, count: int
    ) -> list[E2bSandbox | E2bError]:
        """E2B's fork: one snapshot of the running sandbox, ``count`` sandboxes created
        from it (each with the source's metadata, env and network; each fails on its
        own), then the snapshot deleted. Processes are not carried, as with a snapshot."""
        most = self._max_count()
        if not 1 <= count <= most:
            raise E2bError(400, "bad_request", f"count: must be 1..{most}")
        meta = await self.snapshot(sandbox)
        row = sandbox.row
        results: list[E2bSandbox | E2bError] = []
        try:
            for _ in range(count):
                try:
                    results.append(
                        await self._create(
                            owner=row.namespace,
                            template=meta.snapshot_id,
                            timeout_s=timeout_s,
                            metadata=row.metadata,
                            env=row.env,
                            auto_pause=row.auto_pause,
                            egress=row.egress,
                            public_traffic=row.public_traffic,
                            fork_of=row,
                        )
                    )
                except E2bError as exc:
                    results.append(exc)
                except SandcellError as exc:
                    log.warning("e2b sandbox %s: a fork failed: %s", row.sandbox_id, exc)
                    status = 503 if exc.retryable else 500
                    results.append(E2bError(status, "internal", "the fork could not be started"))
        finally:
            with anyio.CancelScope(shield=True):
                await self._snapshots.delete(row.namespace, meta.snapshot_id)
        return results
