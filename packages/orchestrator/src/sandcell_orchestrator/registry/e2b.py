"""The E2B sandbox table: every E2B sandbox of the fleet, readable by every worker.

An E2B sandbox is a ``SandboxManager`` session plus what E2B's API says about
it (its tenant, template, envd tokens, metadata, env, timeout, running or
paused). ``E2bSandboxRow`` is one row; ``E2bSandboxTable`` is what a registry
backend implements (``sqlite_e2b``, ``redis_e2b``, ``memory``). Rows change by
compare-and-set on ``revision``, so two workers acting on one sandbox at once
never overwrite each other's change unseen.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

from sandcell_protocol import EgressPolicy

from ..stored import StoredDecoder

__all__ = [
    "KILLED_E2B_TTL_S",
    "E2bStartKey",
    "E2bSandboxRow",
    "E2bSandboxState",
    "E2bSandboxTable",
    "validate_e2b_sandbox_id",
]

KILLED_E2B_TTL_S = 24 * 3600
"""How long a removed row's id is remembered as killed (``e2b_sandbox_killed``): far
longer than a pause's store write and compare-and-set take (the race it answers)."""

E2bSandboxState = Literal["running", "paused"]

E2bStartKey = tuple[float, str]
"""Where a row sorts in a listing by start time: its ``(started_at_s, sandbox_id)``."""

_SANDBOX_ID_RE = re.compile(r"[a-z0-9]{20}")


def validate_e2b_sandbox_id(sandbox_id: str) -> str:
    """``sandbox_id`` if it is an E2B sandbox id this service hands out (20 of [a-z0-9]);
    else ``ValueError`` (ids become parts of storage keys)."""
    if not _SANDBOX_ID_RE.fullmatch(sandbox_id):
        raise ValueError("sandbox_id: must be 20 of [a-z0-9]")
    return sandbox_id


class E2bSandboxRow(msgspec.Struct, frozen=True, kw_only=True):
    """One E2B sandbox. Its tokens and env are secrets: ``repr`` leaves them out.

    ``revision`` is 1 when made and one more at every update; timestamps are
    wall-clock epoch seconds (rows are read on other hosts).
    """

    sandbox_id: str
    namespace: str
    template: str
    session_id: str
    access_token: str
    traffic_token: str
    metadata: dict[str, str]
    env: dict[str, str]
    egress: EgressPolicy | None
    started_at_s: float
    end_at_s: float
    auto_pause: bool
    state: E2bSandboxState
    resumes: int = 0
    """How often it was resumed: a worker's handle from before a resume is stale."""
    public_traffic: bool = False
    """Its ports (other than envd's) answer without the traffic token
    (``network.allowPublicTraffic: true`` at create)."""
    cpu_count: int = 0
    """CPUs its runner gives it (the CPU quota, rounded up), as read at create; 0: unknown."""
    memory_mib: int = 0
    """Its runner's memory limit of each job and process, as read at create; 0: unknown."""
    disk_mib: int = 0
    """Its workspace's size (the quota), as read at create; 0: unknown."""
    template_id: str | None = None
    """E2B's ``templateID`` where it is not ``template``: the snapshot (its bare id) it
    was created from, as E2B reports a snapshot template's id (``template`` is then the
    snapshot's source's, whose spec it runs). None: ``template`` itself."""
    alias: str | None = None
    """With ``template_id``: E2B's ``alias``, the snapshot's name (None: unnamed)."""
    revision: int = 1

    def __post_init__(self) -> None:
        validate_e2b_sandbox_id(self.sandbox_id)
        if self.revision < 1:
            raise ValueError("revision: must be >= 1")

    def __repr__(self) -> str:
        return (
            f"E2bSandboxRow(sandbox_id={self.sandbox_id!r}, namespace={self.namespace!r},"
            f" state={self.state!r}, revision={self.revision})"
        )

    def to_json(self) -> bytes:
        """The stored form."""
        return _ENCODER.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> E2bSandboxRow:
        """Parse the stored form; ``msgspec.DecodeError`` (or a subclass) if it is not one."""
        return _DECODER.decode(data)


_ENCODER = msgspec.json.Encoder()
_DECODER = StoredDecoder(E2bSandboxRow)


def decode_row(sandbox_id: str, raw: bytes | str) -> E2bSandboxRow | None:
    """The stored row, or ``None`` if it is unreadable or filed under another id."""
    try:
        row = E2bSandboxRow.from_json(raw)
    except (msgspec.DecodeError, ValueError):
        return None
    return row if row.sandbox_id == sandbox_id else None


@runtime_checkable
class E2bSandboxTable(Protocol):
    """The fleet's E2B sandboxes. Ids are ``validate_e2b_sandbox_id`` ids (``ValueError``)."""

    async def add_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Store a row under an id the table does not hold; ``False`` if the id is taken.

        ``revision`` is kept as given: 1 for a new sandbox; a row rebuilt from the
        snapshot store after a wipe (``e2b/kept.py``) goes on past its last revision, so
        no worker's older view of it can compare-and-set onto the rebuilt row."""
        ...

    async def e2b_sandbox(self, sandbox_id: str) -> E2bSandboxRow | None:
        """The row; ``None`` if missing (or unreadable)."""
        ...

    async def e2b_sandboxes(self) -> list[E2bSandboxRow]:
        """Every row of every namespace, by start time then id: the whole table (the
        full timeout sweep, a worker's kill of all at exit). A tenant's rows are read by
        ``e2b_sandboxes_by_start`` a page at a time, its running ones by
        ``e2b_running_of``."""
        ...

    async def e2b_sandboxes_by_start(
        self,
        namespace: str,
        *,
        after: E2bStartKey | None = None,
        limit: int,
        newest_first: bool = False,
    ) -> list[E2bSandboxRow]:
        """``namespace``'s rows by ``(started_at_s, sandbox_id)`` (the reverse with
        ``newest_first``), the first ``limit`` of those past ``after`` in that order.

        The order of E2B's listing (``GET /v2/sandboxes``). Fewer than ``limit`` means
        there are no more; no row between ``after`` and the last one returned is left
        out, also when ``after`` is the key of a row removed since. A page reads about
        ``limit`` rows, never the namespace's whole table or another namespace's."""
        ...

    async def e2b_due(self, now_s: float, *, limit: int) -> list[E2bSandboxRow]:
        """Running rows whose ``end_at_s`` is at or before ``now_s``, the first ``limit``
        by end (the timeout sweep, every worker, twice a second: it reads these rows,
        not the table). A row last written by an orchestrator that kept no such index
        may be missing here: the sweep reads the whole table now and then for those."""
        ...

    async def e2b_running_of(self, namespace: str) -> list[E2bSandboxRow]:
        """``namespace``'s running rows, by start time then id (the v1 listing, and the
        room check where ``e2b_running_count`` is at the limit): it reads these rows, not
        the paused ones. A row last written by an orchestrator that kept no such index
        may be missing until ``e2b_index`` is given it."""
        ...

    async def e2b_running_count(self, namespace: str) -> int:
        """How many rows ``e2b_running_of`` would answer, without reading them (the room
        check of every create and resume).

        Never fewer, and as many but for what only a read of the rows can tell: index
        entries an older orchestrator's writes left wrong (a row it paused or removed: it
        knows no such index), which ``e2b_running_of`` puts right, and unreadable rows,
        which it skips. So a count at the limit is to be confirmed by ``e2b_running_of``;
        one below it needs no read."""
        ...

    async def e2b_index(self, rows: Sequence[E2bSandboxRow]) -> None:
        """Put ``rows``, as read (a full sweep's), in the indexes of running rows their
        state calls for (``e2b_due``, ``e2b_running_of``), each only if it is still at
        that revision: rows an older orchestrator wrote are indexed this way."""
        ...

    async def e2b_sandboxes_present(self, sandbox_ids: Sequence[str]) -> set[str]:
        """Which of ``sandbox_ids`` have a row, without reading the rows (one round trip
        for a batch: the merge of a tenant's kept rows checks them by the thousand)."""
        ...

    async def e2b_kept_merged(self, namespace: str) -> bool:
        """Whether ``mark_e2b_kept_merged`` marked ``namespace`` within its TTL. A wipe
        takes the mark with it: the next listing merges the store's kept rows again."""
        ...

    async def mark_e2b_kept_merged(self, namespace: str, *, ttl_s: float) -> None:
        """Remember for ``ttl_s`` that ``namespace``'s kept rows are all in the table."""
        ...

    async def update_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Replace the stored row if its revision is ``row.revision - 1`` (compare-and-set);
        ``False`` if it changed meanwhile or is gone. The namespace never changes."""
        ...

    async def remove_e2b_sandbox(self, sandbox_id: str) -> bool:
        """Delete the row; whether there was one. The id is remembered as killed for
        ``KILLED_E2B_TTL_S`` (with or without a row), in the same write as the delete."""
        ...

    async def e2b_sandbox_killed(self, sandbox_id: str) -> bool:
        """Whether the id's row was removed (a kill) in the last ``KILLED_E2B_TTL_S``.

        A kill racing a pause on another worker can have the pauser write the kept row
        to the store after the kill deleted it (``e2b/kept.py``): a row found gone is a
        kill, not a wipe, when this says so, and its kept row goes."""
        ...
