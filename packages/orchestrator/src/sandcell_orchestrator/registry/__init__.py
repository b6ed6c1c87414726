"""The session registry: who holds a runtime session, and where its sandbox lives.

Every runtime session (``rt_…``) has at most one holder at a time. A holder
takes a lease (``SET NX PX`` on a random token), keeps it alive while it works
(``hold_session`` renews it in the background and aborts the work if it is
lost), and is the only one allowed to write the session's ``SessionRecord``.
Leases alone are not enough: a holder paused past its TTL can wake up and write
after someone else took over. So every hold also takes its own generation
(``next_generation``, an ``INCR`` right after the lock is taken) and every write
is fenced by it: a write whose lock token is gone or whose generation is older
than the current one is refused with ``LockLostError`` (``FencedError`` for the
generation case). The generation is also the fencing token at the snapshot
store: a holder writes its checkpoint under a key of its own generation, and
only a fenced record ever points at one.

Backends, chosen by configuration:

    SqliteRegistry      one SQLite file under SANDCELL_HOME, shared by every
                        process on the machine (the embedded default)
    InProcessRegistry   one event loop, no dependencies: only where one process
                        owns every session (``SANDCELL_REGISTRY_URL=memory://``)
    RedisRegistry       redis-py asyncio + Lua scripts (production, many hosts)

They are imported lazily, so the embedded default never imports redis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import msgspec

from sandcell_protocol import is_runtime_session_id

from ..errors import LockLostError
from .lease import hold_session

if TYPE_CHECKING:
    from .memory import InProcessRegistry
    from .redis import RedisRegistry
    from .sqlite import SqliteRegistry

__all__ = [
    "FencedError",
    "IdempotencyEntry",
    "InProcessRegistry",
    "Lease",
    "RedisRegistry",
    "SessionOwner",
    "SessionRecord",
    "SessionRegistry",
    "SessionState",
    "SqliteRegistry",
    "hold_session",
    "validate_idempotency_key",
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


class SessionRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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
_DECODER = msgspec.json.Decoder(SessionRecord)


class SessionOwner(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Whose a runtime session is: the session index every worker reads.

    Records do not carry their tenant (they are written on the lifecycle's hot
    path, by code that knows no tenants); the serving surfaces index a session
    here when a tenant names it, and look it up before any session route.
    """

    session_id: str
    namespace: str
    user_id: str
    hint: str

    def __post_init__(self) -> None:
        validate_session_id(self.session_id)

    def to_json(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> SessionOwner:
        return _OWNER_DECODER.decode(data)


_OWNER_DECODER = msgspec.json.Decoder(SessionOwner)


class IdempotencyEntry(msgspec.Struct, frozen=True, kw_only=True):
    """What a registry holds for an idempotency key someone else already claimed.

    ``done`` is false while the first request still runs (``status`` 0, ``body``
    empty); then ``status`` and ``body`` are the answer it gave, replayed as is.
    """

    fingerprint: str
    done: bool
    status: int
    body: bytes


def validate_idempotency_key(key: str) -> str:
    """Return ``key`` if it is a stored idempotency key (64 lowercase hex digits).

    Callers hash what clients send (tenant, route, header) into one; nothing a
    client names reaches a storage key unhashed.
    """
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError("idempotency key: must be 64 lowercase hex digits")
    return key


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """Proof of holding a session's lock. The token is a secret: ``repr`` hides it.

    ``ttl_ms`` is the TTL the lease was acquired with; renewals pass their own.
    """

    session_id: str
    token: str = field(repr=False)
    ttl_ms: int


@runtime_checkable
class SessionRegistry(Protocol):
    """What ``SandboxManager`` needs from a registry. All ids are runtime session ids.

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

    async def put(self, lease: Lease, record: SessionRecord) -> None:
        """Store ``record`` if ``lease`` holds the lock and its generation is current.

        ``record.session_id`` must be ``lease.session_id`` (``ValueError``).
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

    async def index_session(self, owner: SessionOwner) -> None:
        """Record whose ``owner.session_id`` is (idempotent; the latest write wins)."""
        ...

    async def session_owner(self, session_id: str) -> SessionOwner | None:
        """Whose the session is; ``None`` if it was never indexed (or was unindexed)."""
        ...

    async def sessions_of(self, namespace: str) -> list[SessionOwner]:
        """The sessions indexed for ``namespace``, by session id."""
        ...

    async def unindex_session(self, session_id: str) -> None:
        """Forget whose the session is (it was destroyed); idempotent."""
        ...

    async def claim_idempotency(
        self, key: str, *, fingerprint: str, token: str, ttl_ms: int
    ) -> IdempotencyEntry | None:
        """Claim ``key`` for ``token`` for ``ttl_ms`` if nobody has (``None``); else its entry.

        Atomic: of two concurrent claims exactly one gets ``None``.
        """
        ...

    async def renew_idempotency(self, key: str, *, token: str, ttl_ms: int) -> bool:
        """Keep a pending claim of ``token`` alive for ``ttl_ms``; ``False`` if it is not ours."""
        ...

    async def finish_idempotency(
        self, key: str, *, token: str, status: int, body: bytes, ttl_ms: int
    ) -> bool:
        """Store the answer of ``token``'s claim, kept ``ttl_ms``; ``False`` if not ours."""
        ...

    async def drop_idempotency(self, key: str, *, token: str) -> bool:
        """Forget ``token``'s pending claim (the request failed: a retry runs again)."""
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


def __getattr__(name: str) -> object:
    # Backends load on first use: the embedded default must not import redis.
    if name == "InProcessRegistry":
        from .memory import InProcessRegistry

        return InProcessRegistry
    if name == "RedisRegistry":
        from .redis import RedisRegistry

        return RedisRegistry
    if name == "SqliteRegistry":
        from .sqlite import SqliteRegistry

        return SqliteRegistry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
