"""``SandboxViews``: this worker's objects for E2B sandboxes, in step with their rows.

The table of sandboxes is the registry's (every worker reads it); what stays in a
worker is one ``E2bSandbox`` per sandbox it has seen, with the handle it opened to
it. A view is brought up to date with the row it is read from (its handle closed
when the row says the sandbox was paused or resumed since), and a row is changed
by compare-and-set, re-read when another worker changed it meanwhile. A row
written as paused is kept in the snapshot store too, first (``kept.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec

from ..errors import SandboxNotFoundError, SandcellError
from ..providers.base import SandboxSpec
from ..registry import E2bSandboxRow, SessionRegistry
from ..runner.sandbox import SandboxRunnerClient
from ..sessions.manager import SandboxManager
from .errors import E2bError
from .kept import KeptRows
from .sandbox import E2bSandbox, token_ok

__all__ = ["SandboxViews"]

log = logging.getLogger(__name__)

_CHANGE_ATTEMPTS = 8


class SandboxViews:
    """The sandboxes this worker has seen, with the handles it opened to them."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        spec_of: Callable[[E2bSandboxRow], SandboxSpec],
        kept: KeptRows,
        on_forget: Callable[[str], object] = lambda _sandbox_id: None,
    ) -> None:
        self.manager = manager
        self.kept = kept
        self._spec_of = spec_of
        self._on_forget = on_forget
        self._local: dict[str, E2bSandbox] = {}

    def __len__(self) -> int:
        return len(self._local)

    @property
    def registry(self) -> SessionRegistry:
        return self.manager.registry

    def add(self, sandbox: E2bSandbox) -> None:
        """Keep ``sandbox`` (one this worker just made)."""
        self._local[sandbox.sandbox_id] = sandbox

    def all(self) -> list[E2bSandbox]:
        """Every sandbox this worker holds a view of."""
        return list(self._local.values())

    def clear(self) -> None:
        self._local.clear()

    async def view(self, row: E2bSandboxRow) -> E2bSandbox:
        """This worker's object for ``row``, brought up to date with it."""
        found = self._local.get(row.sandbox_id)
        if found is None or found.gone:
            found = E2bSandbox(row=row, spec=self._spec_of(row))
            self._local[row.sandbox_id] = found
        elif row.revision >= found.row.revision:
            found.row = row
            found.spec = self._spec_of(row)  # its egress may have changed on another worker
        stale = found.row.state != "running" or found.handle_resumes != found.row.resumes
        if found.handle is not None and stale:
            await self.close_handle(found)
        return found

    async def forget(self, sandbox_id: str) -> None:
        """Drop the view of a sandbox that is gone (its handle closed)."""
        found = self._local.pop(sandbox_id, None)
        self._on_forget(sandbox_id)
        if found is not None:
            found.gone = True
            await self.close_handle(found)

    def known(self, sandbox_id: str | None, token: str | None) -> E2bSandbox | None:
        """The view of ``sandbox_id`` if ``token`` is its envd access token (from what
        this worker already read: no registry round trip)."""
        found = self._local.get(sandbox_id or "")
        if found is None or found.gone or not token_ok(found.row, token, None):
            return None
        return found

    async def attach(self, sandbox: E2bSandbox) -> E2bSandbox:
        """Open a handle to a running sandbox this worker has none to (through its session
        record); a sandbox its provider cannot reach from here stays without one."""
        if sandbox.handle is not None or sandbox.state != "running":
            return sandbox
        async with sandbox.lock:
            if sandbox.handle is not None or sandbox.gone or sandbox.state != "running":
                return sandbox
            try:
                handle = await self.manager.connect(sandbox.session_id)
            except SandboxNotFoundError as exc:
                log.warning("e2b sandbox %s: not reachable here: %s", sandbox.sandbox_id, exc)
                return sandbox
            sandbox.handle = handle
            sandbox.runner = SandboxRunnerClient.for_handle(handle)
            sandbox.handle_resumes = sandbox.row.resumes
        return sandbox

    async def close_handle(self, sandbox: E2bSandbox) -> None:
        """Close the handle this worker holds to ``sandbox``, if any."""
        handle, sandbox.handle, sandbox.runner = sandbox.handle, None, None
        if handle is not None:
            with contextlib.suppress(SandcellError):
                await handle.close()

    async def change(
        self,
        sandbox: E2bSandbox,
        change: Callable[[E2bSandboxRow], E2bSandboxRow],
        *,
        prepare: Callable[[E2bSandboxRow], Awaitable[None]] | None = None,
    ) -> None:
        """Apply ``change`` to the stored row by compare-and-set, re-reading it when
        another worker changed it meanwhile; a 404 once it is gone.

        ``prepare`` is awaited before every attempt with the row that attempt would
        replace: what the change does outside the row (a runner's egress) is done for
        that row, and done again for the fresh one after a conflict, so a write that
        lands never rests on a row another worker changed since its side was done.

        A row written as paused is kept in the store before the write (a store that
        fails is the change's error, and the row stays as it was); one that leaves
        paused, or lands running after an attempt that kept one, has its kept row
        deleted after the write (``kept.py``). A row found gone leaves what this
        change kept (the registry may have been wiped under it), unless the registry
        marks the id killed: a kill on another worker deleted the kept row before this
        change wrote it, and it goes again, or lookups would rebuild a killed sandbox."""
        kept = False
        for _ in range(_CHANGE_ATTEMPTS):
            current = sandbox.row
            if prepare is not None:
                await prepare(current)
            changed = msgspec.structs.replace(change(current), revision=current.revision + 1)
            if changed.state == "paused":
                await self.kept.keep(changed)
                kept = True
            if await self.registry.update_e2b_sandbox(changed):
                sandbox.row = changed
                if changed.state != "paused" and (kept or current.state == "paused"):
                    await self.kept.drop_quietly(changed.namespace, changed.sandbox_id)
                return
            fresh = await self.registry.e2b_sandbox(sandbox.sandbox_id)
            if fresh is None or fresh.namespace != sandbox.owner:
                if (
                    kept
                    and fresh is None
                    and await self.registry.e2b_sandbox_killed(sandbox.sandbox_id)
                ):
                    await self.kept.drop_quietly(sandbox.owner, sandbox.sandbox_id)
                await self.forget(sandbox.sandbox_id)
                raise E2bError(404, "not_found", f"sandbox {sandbox.sandbox_id} not found")
            sandbox.row = fresh
        raise E2bError(409, "session_conflict", f"sandbox {sandbox.sandbox_id} keeps changing")

    async def refresh(self, sandbox: E2bSandbox) -> None:
        """Bring ``sandbox`` up to date with its stored row; a 404 once it is gone."""
        fresh = await self.registry.e2b_sandbox(sandbox.sandbox_id)
        if fresh is None or fresh.namespace != sandbox.owner:
            await self.forget(sandbox.sandbox_id)
            raise E2bError(404, "not_found", f"sandbox {sandbox.sandbox_id} not found")
        await self.view(fresh)
