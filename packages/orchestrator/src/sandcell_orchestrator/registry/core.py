"""The registry's core values and store: session records, leases, generations.

``SessionStore`` is what every backend implements for locks, generations,
records and last-seen times; the other concepts a registry holds (the session
index, idempotency keys, the E2B sandbox table, fleet-wide slots) have their own
Protocol in their own module, and ``SessionRegistry`` is all of them together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import msgspec

from sandcell_protocol import is_runtime_session_id

from ..errors import LockLostError
from ..stored import StoredDecoder
from .idempotency import IdempotentAnswer

__all__ = [
    "FencedError",
    "Lease",
    "SessionRecord",
    "SessionState",
    "SessionStore",
    "check_floor",
    "check_ttl",
    "validate_session_id",
]

SessionState = Literal["active", "suspended"]


class FencedError(LockLostError):
    """A write carried a generation older than the session's current one.

    The writer still held the lock, but a newer launch was fenced in after it
    read its generation, so its view of the session is stale.
    """

    def __init__(self, message: str, *, generation: int, current_generation: int) -> None:
        super().__init__(message)
        self.generation = generation
        self.current_generation = current_generation


def validate_session_id(session_id: str) -> str:
    """Return ``session_id`` if it is a runtime session id, else raise ``ValueError``.

    Session ids become parts of storage keys; anything else could address
    another namespace's keys.
    """
    if not is_runtime_session_id(session_id):
        raise ValueError("session_id: must be a runtime session id (rt_ + 64 hex digits)")
    return session_id


class SessionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Where a runtime session's sandbox lives. Stored as JSON; written only under a lease.

    Timestamps are wall-clock epoch seconds supplied by the writer: records are
    read on other hosts, where a monotonic reading means nothing.
    """

    session_id: str
    provider: str
    sandbox_id: str
    # Stable across suspend/resume and provider-side renames; opaque to the registry.
    sandbox_uuid: str
    endpoint: str | None
    generation: int
    checkpoint_key: str | None
    state: SessionState
    created_at_s: float
    updated_at_s: float
    unsaved: bool = False
    """The live sandbox holds acknowledged work no checkpoint has (its checkpoint failed
    past the retry budget): whichever worker takes the next turn on it saves it, even
    if that turn changes nothing. Cleared by a checkpoint and by a new sandbox."""
    turn_open: bool = False
    """A turn is running in the live sandbox: set before its job starts, cleared when the
    turn commits (or ends unchanged, or unsaved). A holder that finds it set took the
    session from one that died or was fenced mid-turn, so the live sandbox may hold an
    uncommitted job's writes: it is replaced from the checkpoint, never reused."""
    adopted: bool = False
    """The checkpoint it points at was taken from the store's listing (a hold found no
    record: a wiped Redis), not committed through this registry: the answers of keyed
    turns up to it are not here, however old the record is, so a keyed turn looks in
    the store before it runs. Cleared by the next checkpoint commit."""

    def __post_init__(self) -> None:
        validate_session_id(self.session_id)
        if self.generation < 0:
            raise ValueError("generation: must be >= 0")
        for name in ("provider", "sandbox_id", "sandbox_uuid"):
            if not getattr(self, name):
                raise ValueError(f"{name}: must be non-empty")

    def to_json(self) -> bytes:
        """The stored form; ``ValueError`` if it would not read back (e.g. a bad ``state``)."""
        raw = _ENCODER.encode(self)
        # msgspec checks field types only when decoding: refuse to store a
        # record that every later read would treat as corrupt.
        try:
            _DECODER.decode(raw)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid session record: {exc}") from exc
        return raw

    @classmethod
    def from_json(cls, data: bytes | str) -> SessionRecord:
        """Parse the stored form; ``msgspec.DecodeError`` (or a subclass) if it is not one."""
        return _DECODER.decode(data)


_ENCODER = msgspec.json.Encoder()
_DECODER = StoredDecoder(SessionRecord)


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """Proof of holding a session's lock. The token is a secret: ``repr`` hides it.

    ``ttl_ms`` is the TTL the lease was acquired with; renewals pass their own.
    """

    session_id: str
    token: str = field(repr=False)
    ttl_ms: int


@runtime_checkable
class SessionStore(Protocol):
    """Locks, generations, records and last-seen times: what ``SandboxManager`` needs.

    All ids are runtime session ids.

    Errors: a backend failure raises ``RegistryError``; a refused write raises
    ``LockLostError`` (lock token gone) or ``FencedError`` (stale generation);
    an id that is not ``rt_…`` raises ``ValueError``.
    """

    async def acquire_lock(self, session_id: str, *, ttl_ms: int) -> Lease | None:
        """Take the session's lock for ``ttl_ms``; ``None`` if someone else holds it."""
        ...

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        """Reset the lock's TTL to ``ttl_ms`` if it is still ours; ``False`` if not."""
        ...

    async def release(self, lease: Lease) -> bool:
        """Drop the lock if it is still ours (compare-and-delete); ``False`` if not."""
        ...

    async def next_generation(self, session_id: str, *, above: int = 0) -> int:
        """Increment and return the session's generation (1, 2, …); never reused.

        ``above`` is a floor: the result is greater than it even if the counter
        was lost (a registry restarted without persistence, an in-process
        registry of a new process), because the snapshot store still holds
        checkpoints keyed by older generations.
        """
        ...

    async def current_generation(self, session_id: str) -> int:
        """The session's generation; 0 if ``next_generation`` was never called."""
        ...

    async def get(self, session_id: str) -> SessionRecord | None:
        """The session's record; ``None`` if missing or corrupt (logged once, id only)."""
        ...

    async def put(
        self, lease: Lease, record: SessionRecord, *, answer: IdempotentAnswer | None = None
    ) -> None:
        """Store ``record`` if ``lease`` holds the lock and its generation is current.

        ``record.session_id`` must be ``lease.session_id`` (``ValueError``). With
        ``answer``, the same atomic write also stores it as its key's answer (if its
        token still holds the claim): the write that commits a turn carries the
        turn's answer, so no crash can leave one without the other.
        """
        ...

    async def delete(self, lease: Lease, session_id: str, *, generation: int) -> None:
        """Remove the record and last-seen entry, fenced like ``put`` by ``generation``.

        The generation counter survives, so a re-created session keeps fencing
        out writers of the old one.
        """
        ...

    async def touch(self, session_id: str, *, at_s: float) -> None:
        """Record that the session was used at wall-clock ``at_s`` (never moves back)."""
        ...

    async def idle_sessions(self, *, older_than_s: float, now_s: float) -> list[str]:
        """Sessions last seen at or before ``now_s - older_than_s``, oldest first."""
        ...

    async def list_records(self) -> list[SessionRecord]:
        """Every readable record, by session id; corrupt ones are skipped (logged)."""
        ...

    async def close(self) -> None:
        """Release connections; idempotent."""
        ...


class _CorruptRecordLog:
    """Warn once per session about a corrupt record, naming only the session id.

    The raw bytes are never logged: they are untrusted and may be large.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._warned: set[str] = set()

    def corrupt(self, session_id: str) -> None:
        if session_id in self._warned:
            self._logger.debug("session record for %s is still corrupt", session_id)
            return
        self._warned.add(session_id)
        self._logger.warning("session record for %s is corrupt; treating it as missing", session_id)

    def repaired(self, session_id: str) -> None:
        self._warned.discard(session_id)

    def decode(self, session_id: str, raw: bytes | str) -> SessionRecord | None:
        try:
            record = SessionRecord.from_json(raw)
        except msgspec.DecodeError:
            self.corrupt(session_id)
            return None
        if record.session_id != session_id:
            # A record filed under another session's key is as unusable as garbage.
            self.corrupt(session_id)
            return None
        return record


def check_floor(above: int) -> None:
    """``ValueError`` unless ``above`` is a generation floor (an int >= 0)."""
    if isinstance(above, bool) or not isinstance(above, int) or above < 0:
        raise ValueError("above: must be an int >= 0")


def check_ttl(ttl_ms: int) -> None:
    """``ValueError`` unless ``ttl_ms`` is a positive TTL."""
    if ttl_ms <= 0:
        raise ValueError("ttl_ms: must be > 0")
