"""``SandboxPauses``: E2B's pause and connect (resume) of a tenant's sandbox.

A pause keeps the runner's metrics samples, suspends the session (natively on
Lambda MicroVMs, checkpoint-and-destroy elsewhere: the manager's one suspend
policy) and writes the row paused; a connect resumes it (the workspace restored
before anything runs, the egress policy the row holds applied) within the tenant's
cap of running sandboxes, or extends a running one's timeout.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import msgspec

from ..errors import SandcellError
from ..registry import E2bSandboxRow
from ..runner.sandbox import SandboxRunnerClient
from ..sessions.manager import SandboxManager
from .creation import SandboxCreation
from .errors import UNSAVABLE, unsavable
from .metrics import SandboxMetrics
from .network import SandboxNetwork
from .sandbox import E2bSandbox
from .views import SandboxViews

__all__ = ["SandboxPauses"]

log = logging.getLogger(__name__)


class SandboxPauses:
    """Pause and resume tenants' sandboxes."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        views: SandboxViews,
        network: SandboxNetwork,
        creation: SandboxCreation,
        metrics: SandboxMetrics,
        now: Callable[[], float],
    ) -> None:
        self._manager = manager
        self._views = views
        self._network = network
        self._creation = creation
        self._metrics = metrics
        self._now = now

    async def pause(self, sandbox: E2bSandbox) -> bool:
        """Suspend a running sandbox (its workspace and metrics samples are saved);
        False if already paused."""
        await self._views.attach(sandbox)  # takes the lock itself: before it is held
        async with sandbox.lock:
            await self._views.refresh(sandbox)
            if sandbox.state == "paused":
                return False
            await self._metrics.keep(sandbox)
            # Suspended first: if that fails the sandbox runs on, reachable as before.
            try:
                await self._manager.suspend(sandbox.session_id)
            except UNSAVABLE as exc:
                # The tenant's own files: a 4xx naming why, not the store's 500.
                raise unsavable(
                    sandbox.sandbox_id,
                    exc,
                    what="a pause may save",
                    most_bytes=self._manager.persistence.max_bytes,
                    after="; it runs on",
                ) from None
            await self._views.close_handle(sandbox)
            await self._views.change(
                sandbox, lambda row: msgspec.structs.replace(row, state="paused")
            )
        log.info("e2b sandbox %s paused", sandbox.sandbox_id)
        return True

    async def connect(self, sandbox: E2bSandbox, *, timeout_s: int | None) -> E2bSandbox:
        """Resume a paused sandbox (workspace restored first); a running one's timeout is
        extended when ``timeout_s`` ends later than its current end."""
        async with sandbox.lock:
            await self._views.refresh(sandbox)
            end = self._now() + self._creation.timeout(timeout_s)
            if sandbox.state == "paused":
                await self._creation.check_room(sandbox.owner)
                # ``adopt``: a row rebuilt after a wipe has no session record left; its
                # newest checkpoint is the workspace it was paused with.
                attached = await self._manager.resume(sandbox.session_id, sandbox.spec, adopt=True)
                handle = attached.handle
                # What the runner enforces: the spec's if it was launched for this resume;
                # unknown if it was resumed in place (a MicroVM keeps the policy it was
                # suspended with) or was running (a resume that never wrote the row).
                enforced = self._network.egress(sandbox.row) if attached.launched else None

                async def align(row: E2bSandboxRow) -> None:
                    # An update that landed since the spec was read (on any worker) left
                    # this runner to us (``network``'s docstring says why).
                    nonlocal enforced
                    wanted = self._network.egress(row)
                    if wanted != enforced:
                        await self._manager.apply_egress(handle, wanted)
                        enforced = wanted

                try:
                    await self._views.change(
                        sandbox,
                        lambda row: msgspec.structs.replace(
                            row, state="running", end_at_s=end, resumes=row.resumes + 1
                        ),
                        prepare=align,
                    )
                except BaseException:
                    with contextlib.suppress(SandcellError):
                        await handle.close()
                    raise
                sandbox.handle = handle
                sandbox.runner = SandboxRunnerClient.for_handle(handle)
                sandbox.handle_resumes = sandbox.row.resumes
                log.info("e2b sandbox %s resumed", sandbox.sandbox_id)
            elif timeout_s is not None and end > sandbox.end_at_s:
                await self._views.change(
                    sandbox,
                    lambda row: msgspec.structs.replace(row, end_at_s=max(end, row.end_at_s)),
                )
        return sandbox
