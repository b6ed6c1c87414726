"""``SandboxNetwork``: an E2B sandbox's egress policy, replaced while it runs or sleeps.

E2B's ``PUT /sandboxes/{id}/network`` replaces the policy on the sandbox's runner at
once (when it runs) and in its row, so a resume on any worker launches with it.

Why a running sandbox ends on its row's policy, however an update on one worker and a
resume on another interleave (the per-sandbox lock is per worker; only the row's
compare-and-set on ``revision`` orders them): both do their runner side *before* their
write of the row, for the row that write replaces, and again for the fresh row after
every conflict (``views.SandboxViews.change``'s ``prepare``). A write that lands had
its runner side done for the very row it replaced (no write came between), and a
runner step another worker took after it belongs to a write not landed yet, which
fails against the newer revision and is redone on top of it. So the last runner step
is the last write's, and the runner holds the row's policy:

- the update reads "paused", the resume launches with the old spec: whichever write
  lands second re-reads; the update finds "running" and applies to the runner the
  session record names (the resume recorded it before its write), or the resume finds
  the new egress and applies it to the runner it launched (``SandboxPauses.connect``);
- two updates: the one that lands second applies its policy again, after the other;
- a resume whose runner was not launched from the row it read (resumed in place, or
  left running by a resume that never wrote the row) applies the row's policy even at
  its first write.

A pause suspends before its write; timeout and metadata writes touch no runner. An
update whose write never landed puts the runner back on the row's policy (as this
worker last read it) before it answers its error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from sandcell_protocol import EgressPolicy

from ..providers.base import SandboxSpec
from ..registry import E2bSandboxRow
from ..sessions.manager import SandboxManager
from ..to_the_end import to_the_end
from .sandbox import E2bSandbox
from .views import SandboxViews

__all__ = ["SandboxNetwork"]

log = logging.getLogger(__name__)


class SandboxNetwork:
    """Egress policies of E2B sandboxes: what a runner of a row enforces, and updates."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        views: SandboxViews,
        spec_of: Callable[[E2bSandboxRow], SandboxSpec],
    ) -> None:
        self._manager = manager
        self._views = views
        self._spec_of = spec_of

    def __repr__(self) -> str:
        return "SandboxNetwork()"

    def egress(self, row: E2bSandboxRow) -> EgressPolicy:
        """The policy a runner of ``row`` enforces (sandcell's default, ``deny_all``, when
        neither the row nor its template names one: a runner launched without one)."""
        return self._spec_of(row).egress or EgressPolicy()

    async def replace(self, sandbox: E2bSandbox, policy: EgressPolicy | None) -> None:
        """Replace the sandbox's egress policy (None: its template's): on its runner at
        once when it runs, and in its row, so a resume (on any worker) launches with it."""

        applied: list[str] = []

        async def on_runner(row: E2bSandboxRow) -> None:
            if row.state == "running":
                # The runner first: if it refuses, the sandbox keeps the policy it has.
                wanted = self.egress(msgspec.structs.replace(row, egress=policy))
                applied.append(row.session_id)
                await self._manager.set_egress(row.session_id, wanted)

        async with sandbox.lock:
            await self._views.refresh(sandbox)
            try:
                await self._views.change(
                    sandbox,
                    lambda row: msgspec.structs.replace(row, egress=policy),
                    prepare=on_runner,
                )
            except BaseException:
                if applied:
                    # The row was not written (a registry outage, a gone sandbox, the
                    # caller cancelled): the runner goes back to what the row holds, or a
                    # failed update would still be enforced, and differ from what a resume
                    # launches with.
                    await to_the_end(self._put_back(sandbox, applied[-1]))
                raise
            sandbox.spec = self._spec_of(sandbox.row)
        log.info("e2b sandbox %s: egress policy replaced", sandbox.sandbox_id)

    async def _put_back(self, sandbox: E2bSandbox, session_id: str) -> None:
        """Put the policy of the sandbox's row (as this worker last read it) back on the
        runner of ``session_id``; a failure is logged: the update's own error is the answer."""
        try:
            await self._manager.set_egress(session_id, self.egress(sandbox.row))
        except Exception as exc:  # the update's error is what the caller needs
            log.warning(
                "e2b sandbox %s: egress policy not put back after a failed update: %s",
                sandbox.sandbox_id,
                type(exc).__name__,
            )
