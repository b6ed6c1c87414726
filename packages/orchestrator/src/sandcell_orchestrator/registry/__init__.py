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

Each concept a registry holds has its Protocol in the module that owns it, and
each backend implements it in a module of its own beside the backend's core:

    core.py         SessionStore: locks, generations, records, last-seen
    index.py        SessionIndex: whose each session is
    idempotency.py  IdempotencyStore: keyed requests and their answers
    e2b.py          E2bSandboxTable: the fleet's E2B sandboxes
    slots.py        SlotCounter: fleet-wide counted, expiring slots

``SessionRegistry`` is all of them: what every backend is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .core import (
    FencedError,
    Lease,
    SessionRecord,
    SessionState,
    SessionStore,
    validate_session_id,
)
from .e2b import (
    E2bSandboxRow,
    E2bSandboxState,
    E2bSandboxTable,
    E2bStartKey,
    validate_e2b_sandbox_id,
)
from .idempotency import (
    IdempotencyEntry,
    IdempotencyStore,
    IdempotentAnswer,
    validate_idempotency_key,
)
from .index import SessionIndex, SessionOwner
from .lease import hold_session
from .slots import SlotCounter, validate_slot_scope

if TYPE_CHECKING:
    from .memory import InProcessRegistry
    from .redis import RedisRegistry
    from .sqlite import SqliteRegistry

__all__ = [
    "E2bSandboxRow",
    "E2bSandboxState",
    "E2bSandboxTable",
    "E2bStartKey",
    "FencedError",
    "IdempotencyEntry",
    "IdempotentAnswer",
    "IdempotencyStore",
    "InProcessRegistry",
    "Lease",
    "RedisRegistry",
    "SessionIndex",
    "SessionOwner",
    "SessionRecord",
    "SessionRegistry",
    "SessionState",
    "SessionStore",
    "SlotCounter",
    "SqliteRegistry",
    "hold_session",
    "validate_e2b_sandbox_id",
    "validate_idempotency_key",
    "validate_session_id",
    "validate_slot_scope",
]


@runtime_checkable
class SessionRegistry(
    SessionStore, SessionIndex, IdempotencyStore, E2bSandboxTable, SlotCounter, Protocol
):
    """Everything a registry backend holds (each part is documented where it is defined).

    Errors: a backend failure raises ``RegistryError``; a refused write raises
    ``LockLostError`` (lock token gone) or ``FencedError`` (stale generation);
    an id of the wrong shape raises ``ValueError``.
    """


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
