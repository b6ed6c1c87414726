"""``TimeoutSweep``: E2B sandboxes past their end are killed, or paused with ``autoPause``.

Every worker sweeps (``E2bSandboxes.expire``, twice a second); the actions are safe
to race (a pause holds the session, a kill removes the row first). A sweep reads the
rows that are due (the registry's ``e2b_due`` index), not the table; the first sweep
and one every ``FULL_SWEEP_S`` read every row instead. A failed action waits
``_RETRY_EXPIRY_S`` before this worker tries it again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from ..errors import SandcellError
from ..metrics import Metrics
from ..registry import E2bSandboxRow, SessionRegistry
from .errors import E2bError
from .sandbox import E2bSandbox

__all__ = ["FULL_SWEEP_S", "TIMEOUT_PAUSE_ATTEMPTS", "TimeoutSweep"]

log = logging.getLogger(__name__)

_RETRY_EXPIRY_S = 30.0
TIMEOUT_PAUSE_ATTEMPTS = 3
"""Failed auto-pauses at a sandbox's timeout before it is killed instead (this worker's
count, ``_RETRY_EXPIRY_S`` apart): E2B ends a sandbox at its timeout whether or not the
pause saved it, so sandcell retries a store that is briefly down, then ends it too."""
_DUE_ROWS = 1000
"""Due rows one sweep reads at most; the rest wait for the next sweep, half a second on."""

FULL_SWEEP_S = 600.0
"""How often the timeout sweep reads every row, not only the index of due ones."""


class TimeoutSweep:
    """Ends the sandboxes of ``registry`` whose timeout passed, through ``pause``/``kill``."""

    def __init__(
        self,
        registry: Callable[[], SessionRegistry],
        *,
        view: Callable[[E2bSandboxRow], Awaitable[E2bSandbox]],
        pause: Callable[[E2bSandbox], Awaitable[bool]],
        kill: Callable[[E2bSandbox], Awaitable[None]],
        metrics: Metrics,
        now: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._view = view
        self._pause = pause
        self._kill = kill
        self._metrics = metrics
        self._now = now
        # sandbox id -> wall-clock time before which the sweep leaves it be.
        self._retry_at: dict[str, float] = {}
        # sandbox id -> failed auto-pauses at its timeout (``TIMEOUT_PAUSE_ATTEMPTS``).
        self._pause_failures: dict[str, int] = {}
        self._full_sweep_at = 0.0

    async def expire(self) -> int:
        """Kill (or, with ``autoPause``, pause) running sandboxes past their end; how many.

        The first sweep and one every ``FULL_SWEEP_S`` read every row, for rows an older
        orchestrator wrote (the index does not have them: during and after a rolling
        upgrade their timeout fires at most that late)."""
        registry = self._registry()
        now = self._now()
        if now >= self._full_sweep_at:
            self._full_sweep_at = now + FULL_SWEEP_S
            candidates = await registry.e2b_sandboxes()
            # Running rows an older orchestrator wrote are in neither index until given
            # to it; a paused one left in an index is put right by the read that meets it.
            await registry.e2b_index([row for row in candidates if row.state == "running"])
        else:
            candidates = await registry.e2b_due(now, limit=_DUE_ROWS)
        due = [
            row
            for row in candidates
            if row.state == "running"
            and row.end_at_s <= now
            and self._retry_at.get(row.sandbox_id, 0) <= now
        ]
        for row in due:
            sandbox = await self._view(row)
            try:
                if sandbox.auto_pause:
                    await self._pause_at_timeout(sandbox)
                else:
                    await self._kill(sandbox)
            except (SandcellError, E2bError) as exc:
                # Tried again later, not on every sweep.
                self._retry_at[row.sandbox_id] = self._now() + _RETRY_EXPIRY_S
                log.warning("e2b sandbox %s: timeout action failed: %s", row.sandbox_id, exc)
        return len(due)

    async def _pause_at_timeout(self, sandbox: E2bSandbox) -> None:
        """``autoPause`` at the timeout: paused, or killed when the pause cannot be had.

        E2B ends a sandbox at its timeout: its evictor removes the sandbox whether or
        not the pause's snapshot succeeds (e2b-dev/infra ``RemoveSandbox``: the store
        record goes and the VM is stopped either way). A workspace that cannot be saved
        (the 413 of ``unsavable``: past ``SANDCELL_CHECKPOINT_MAX_BYTES``, or of more
        entries than a checkpoint holds) can never be paused, so it is killed at once;
        any other failure (a store that is down) is retried up to
        ``TIMEOUT_PAUSE_ATTEMPTS`` times, then killed. Until then it keeps counting
        against the tenant's running sandboxes, as it would have without the kill."""
        try:
            await self._pause(sandbox)
        except (SandcellError, E2bError) as exc:
            if isinstance(exc, E2bError) and exc.status == 413:
                # The 413's own message says which cap (bytes or entries) it is past.
                reason, why = "too_large", f"{exc.code}: {exc}"
            else:
                failures = self._pause_failures.get(sandbox.sandbox_id, 0) + 1
                self._pause_failures[sandbox.sandbox_id] = failures
                if failures < TIMEOUT_PAUSE_ATTEMPTS:
                    raise
                reason, why = "failed", f"it failed {failures} times (last: {exc})"
        else:
            self._pause_failures.pop(sandbox.sandbox_id, None)
            return
        log.warning(
            "e2b sandbox %s: the auto-pause at its timeout cannot be done (%s): killing it,"
            " as E2B ends a sandbox at its timeout",
            sandbox.sandbox_id,
            why,
        )
        self._metrics.inc("sandcell_e2b_timeout_pause_kills_total", reason=reason)
        await self._kill(sandbox)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone from this worker's view: no retry is pending for it."""
        self._retry_at.pop(sandbox_id, None)
        self._pause_failures.pop(sandbox_id, None)
