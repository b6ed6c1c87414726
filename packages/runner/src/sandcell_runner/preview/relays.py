"""How much the preview relays at once: WebSockets and plain requests, each capped.

A runner serves one sandbox, so these caps are per sandbox. What a relay holds (two
sockets here; two sockets and two tasks in the orchestrator in front of it) is not
the job's: no cgroup charges it, and without a cap only the tenant app's own limits
ended a flood of them (300 WebSockets at one E2B port all reached the relay). Past a
cap a relay is refused at once, ``503 busy`` naming the cap, never queued: a queue
would hold the very sockets the cap bounds, and the clients that open many (a dev
server's hot-reload client, a browser) retry.

A slot is held from the checks until the relay ends however it ends (either side
closes or drops, an error), and given back exactly once. Releasing a session aborts
its relays (their upstream sockets are closed, which ends them) and frees their slots
at once, so a relay never outlives its session, nor its count the next one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BusyError


class RelaySlot:
    """One relay's place under its cap; ``release`` is idempotent."""

    def __init__(self, limit: RelayLimit, session_id: str) -> None:
        self.session_id = session_id
        self._limit = limit
        self._abort: Callable[[], object] | None = None

    def on_abort(self, abort: Callable[[], object]) -> None:
        """What ends this relay from outside (closing its upstream), once it has one."""
        self._abort = abort

    def abort(self) -> None:
        """End the relay (its session is released) and give its place back now."""
        abort, self._abort = self._abort, None
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()
        self.release()

    def release(self) -> None:
        """Give the place back (the relay ended)."""
        self._abort = None
        self._limit.discard(self)


class RelayLimit:
    """At most ``cap`` relays of one kind at once; a claim past it is a ``BusyError``."""

    def __init__(self, cap: int, *, what: str, setting: str) -> None:
        self.cap = cap
        self._what = what
        self._setting = setting
        self._held: set[RelaySlot] = set()

    @property
    def active(self) -> int:
        """Relays holding a slot now."""
        return len(self._held)

    def claim(self, session_id: str) -> RelaySlot:
        """A slot for one more relay of ``session_id``, or ``BusyError`` at the cap."""
        if len(self._held) >= self.cap:
            raise BusyError(
                f"this sandbox already relays {self.cap} {self._what} to its ports, "
                f"the most it may ({self._setting}={self.cap}); close one or retry"
            )
        slot = RelaySlot(self, session_id)
        self._held.add(slot)
        return slot

    def discard(self, slot: RelaySlot) -> None:
        self._held.discard(slot)

    def abort_session(self, session_id: str) -> None:
        """Abort every relay of ``session_id`` (its slots are free on return)."""
        for slot in [s for s in self._held if s.session_id == session_id]:
            slot.abort()


@dataclass(frozen=True, slots=True)
class PreviewRelays:
    """The runner's two caps: upgrades (WebSockets, tunnels) and plain requests."""

    websockets: RelayLimit
    requests: RelayLimit

    @classmethod
    def create(cls, *, max_websockets: int, max_requests: int) -> PreviewRelays:
        return cls(
            websockets=RelayLimit(
                max_websockets,
                what="WebSockets",
                setting="SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS",
            ),
            requests=RelayLimit(
                max_requests,
                what="HTTP requests",
                setting="SANDCELL_RUNNER_MAX_RELAYED_REQUESTS",
            ),
        )

    def abort_session(self, session_id: str) -> None:
        """End the session's relays and free their slots (the session is released)."""
        self.websockets.abort_session(session_id)
        self.requests.abort_session(session_id)


__all__ = ["PreviewRelays", "RelayLimit", "RelaySlot"]
