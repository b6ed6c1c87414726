"""The refusals one turn's job met, for its execute stream (protocol 1.2).

A turn that streams to a peer speaking 1.2 watches the namespace its job runs in
(the bound session's, or the one jobs outside a session share): every refusal
that namespace's gateway reports while the turn runs is kept here, up to
``MAX_EGRESS_EVENTS_PER_TURN``, and the rest only counted. The stream takes them
as they come (``take``) and, once the job has ended and the gateway has been
asked to write out every decision so far, the count of the rest (``omitted``).

What is kept is bounded per turn whatever the job does (a loop of refused
connects costs a counter, not memory): the job pays, the runner does not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sandcell_protocol import (
    MAX_EGRESS_EVENTS_PER_TURN,
    EgressEvent,
    EgressOmittedEvent,
    EgressRefusedEvent,
)


def refused_event(event: EgressEvent) -> EgressRefusedEvent:
    """The stream's event for one refusal the gateway reported."""
    return EgressRefusedEvent(
        reason=event.reason,
        transport=event.transport,
        name=event.name,
        address=event.address,
        port=event.port,
        at_ms=event.at_ms,
    )


class TurnRefusals:
    """See the module docstring. ``add`` runs on the gateway's reader thread."""

    def __init__(
        self,
        *,
        session: bool,
        notify: Callable[[], None],
        limit: int = MAX_EGRESS_EVENTS_PER_TURN,
    ) -> None:
        self.session = session
        """Which namespace: the bound session's (True) or the shared one."""
        self._notify = notify
        self._limit = limit
        self._lock = threading.Lock()
        self._pending: list[EgressRefusedEvent] = []
        self._kept = 0
        self._omitted = 0

    def add(self, event: EgressEvent) -> None:
        with self._lock:
            if self._kept >= self._limit:
                self._omitted += 1
                return
            self._kept += 1
            self._pending.append(refused_event(event))
        self._notify()

    def take(self) -> list[EgressRefusedEvent]:
        """The refusals not taken yet, oldest first."""
        with self._lock:
            taken, self._pending = self._pending, []
        return taken

    def omitted(self) -> EgressOmittedEvent | None:
        """How many refusals were past the limit (None: none were)."""
        with self._lock:
            return EgressOmittedEvent(count=self._omitted) if self._omitted else None


__all__ = ["TurnRefusals", "refused_event"]
