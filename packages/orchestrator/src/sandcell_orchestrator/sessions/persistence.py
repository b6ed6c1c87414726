"""``Persistence``: the only stream between a runner and the snapshot store.

A checkpoint goes out of the runner (``GET /v1/session/checkpoint``) straight
into the store, and a restore goes from the store straight into the runner
(``POST /v1/session/restore``, the digest checked by the runner); nothing else
moves checkpoint bytes. Keys come from the protocol:

    checkpoints/<rt>/<generation, 20 digits>   written once, by that generation's holder
    checkpoints/<rt>/<generation>.turn-<key>    the result of the keyed turn that wrote it
    checkpoints/<rt>/answer-<key>               a committed keyed turn's result, by key
    checkpoints/<rt>.tar.gz                     the old mutable key: read, never written
    snapshots/<rt>.tar.gz                       the old app-sandbox key: read via a record
    answers/<key>                               a keyed stateless run's answer, by key
                                                (not this module's: ``stateless_answers.py``)
    owners/<sha256 of the namespace>/<rt>       whose the session is (not this module's:
                                                ``owners.py``)

Fencing at the store: a holder writes only under its own generation's key, so a
holder paused past its lock cannot replace anybody's object; the fenced registry
record is the one pointer to the current object, and a stale writer's object is
never pointed at. Superseded objects are collected once they are older than a
grace period (``collect``); the newest one stays findable from the store alone
(``latest``), which is how a session comes back when no record survived.

A keyed turn (an ``Idempotency-Key``) writes its result next to its checkpoint,
named by the key, before the record write that commits it. The registry keeps
the key's answer too, but a registry that forgot everything (a Redis without
persistence, wiped) would let a retry run the turn a second time on the object
that already holds its first run; the object's own result says it was applied.
That result is found only by a retry restoring that very object, the newest; a
later checkpoint (an idle suspend, the next turn) or a turn that changed nothing
hides it. So a keyed turn also writes its result under its key alone
(``answer-<key>``: the stored idempotency key, a hash of surface, tenant and
header, under the session's own prefix), once its commit is written and before
it answers: that object exists only for a committed turn, whichever checkpoint a
retry restores. It is collected like a superseded checkpoint, once older than the
grace period (``collect``), and goes with the session (``delete_all``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sandcell_protocol import (
    checkpoint_key,
    checkpoint_prefix,
    legacy_checkpoint_key,
    parse_checkpoint_key,
)

from ..handle import SandboxHandle
from ..snapshots import SnapshotEntry, SnapshotInfo, SnapshotNotFoundError, SnapshotStore
from ..snapshots.collection import collect_key
from ..snapshots.whole import put_whole, read_whole

__all__ = [
    "Persistence",
    "PersistentWorkspace",
    "StoredCheckpoint",
    "TurnResult",
    "answer_key",
]


@dataclass(frozen=True, slots=True)
class PersistentWorkspace:
    """Which workspace paths a checkpoint keeps (glob patterns, relative to the workspace)."""

    include: tuple[str, ...] = ("**",)
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """A session's checkpoint object as the store shows it."""

    key: str
    generation: int
    """The writer's generation; 0 for an object under an old (ungenerational) key."""
    modified_at_s: float
    turn_key: str | None = None
    """The idempotency key of the keyed turn whose checkpoint this is, when its result
    was saved with it (``save_turn_result``)."""
    result_key: str | None = None
    """The object holding that turn's result."""
    restorable: bool = True
    """False for a turn result whose checkpoint is not there (its upload failed after
    the result was saved), and for a committed turn's answer (``answer-<key>``):
    listed only so that collection removes it."""


@dataclass(frozen=True, slots=True)
class TurnResult:
    """What a keyed turn saves with its checkpoint: its stored idempotency key and its
    result, encoded. The body is a tenant's output: ``repr`` leaves it out."""

    turn_key: str
    body: bytes = field(repr=False)


_TURN_MARK = ".turn-"
_TURN_RESULT_MAX_BYTES = 64 << 20
"""A turn result is a job's captured output: the runner's own caps keep it far below."""


_ANSWER_MARK = "answer-"


def answer_key(session_id: str, turn_key: str) -> str:
    """The key of the committed keyed turn ``turn_key``'s result (``save_answer``)."""
    return f"{checkpoint_prefix(session_id)}{_ANSWER_MARK}{turn_key}"


def turn_result_key(checkpoint: str, turn_key: str) -> str:
    """The key of the result of the keyed turn ``turn_key`` (a stored idempotency key,
    64 hex digits) saved with ``checkpoint``."""
    return f"{checkpoint}{_TURN_MARK}{turn_key}"


class Persistence:
    """Checkpoint and restore through one ``SnapshotStore``, and its per-session listing."""

    def __init__(
        self,
        store: SnapshotStore,
        *,
        max_bytes: int = 1 << 30,
        grace_s: float = 600.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self._now = wall_clock

    def __repr__(self) -> str:
        return f"Persistence({self.store!r})"

    async def save(
        self,
        handle: SandboxHandle,
        *,
        session_id: str,
        generation: int,
        workspace: PersistentWorkspace | None = None,
    ) -> SnapshotInfo:
        """Stream the session's checkpoint into its own generation's key (never replaced)."""
        return await self.save_to(
            handle,
            session_id=session_id,
            key=checkpoint_key(session_id, generation),
            workspace=workspace,
        )

    async def save_to(
        self,
        handle: SandboxHandle,
        *,
        session_id: str,
        key: str,
        workspace: PersistentWorkspace | None = None,
    ) -> SnapshotInfo:
        """Stream the session's workspace into ``key``, a key of the caller's own (an E2B
        snapshot's): not one of the session's checkpoints, so nothing collects it."""
        selection = workspace or PersistentWorkspace()
        async with handle.runner.checkpoint(
            session_id=session_id, include=selection.include, exclude=selection.exclude
        ) as chunks:
            return await self.store.put(key, chunks, max_bytes=self.max_bytes)

    async def save_turn_result(self, checkpoint: str, *, turn_key: str, body: bytes) -> None:
        """Store the result of the keyed turn about to write ``checkpoint``, next to it.

        Saved before the checkpoint itself: a checkpoint without its result would be a
        keyed turn applied that nobody can recognise (a holder cancelled right after
        the upload, its lock lost); a result without its checkpoint names nothing."""
        await put_whole(
            self.store,
            turn_result_key(checkpoint, turn_key),
            body,
            max_bytes=_TURN_RESULT_MAX_BYTES,
        )

    async def turn_result(self, item: StoredCheckpoint) -> bytes | None:
        """The saved result of the keyed turn that wrote ``item`` (None: none saved)."""
        if item.result_key is None:
            return None
        return await self._read(item.result_key)

    async def result_with(self, checkpoint: str, turn_key: str) -> bytes | None:
        """The result of the keyed turn ``turn_key`` saved with ``checkpoint`` (None:
        that checkpoint is not that turn's)."""
        try:
            return await self._read(turn_result_key(checkpoint, turn_key))
        except SnapshotNotFoundError:
            return None

    async def save_answer(self, session_id: str, *, turn_key: str, body: bytes) -> None:
        """Store the result of the keyed turn ``turn_key``, committed just now, by its key.

        Written after the commit, never before: the object says the turn is applied
        in the session's state, whatever checkpoint a later holder restores."""
        await put_whole(
            self.store, answer_key(session_id, turn_key), body, max_bytes=_TURN_RESULT_MAX_BYTES
        )

    async def answer(self, session_id: str, turn_key: str) -> bytes | None:
        """The committed keyed turn ``turn_key``'s result (``save_answer``); None: none."""
        try:
            return await self._read(answer_key(session_id, turn_key))
        except SnapshotNotFoundError:
            return None

    async def _read(self, key: str) -> bytes:
        return await read_whole(self.store, key, max_bytes=_TURN_RESULT_MAX_BYTES)

    async def restore(
        self,
        handle: SandboxHandle,
        *,
        session_id: str,
        key: str,
        timeout_s: float | None,
        taken_of: str | None = None,
    ) -> None:
        """Stream the object under ``key`` into the session; the runner checks its digest
        (and that it is the session's, or ``taken_of``'s: a copy of another's)."""
        async with self.store.get(key, max_bytes=self.max_bytes) as snapshot:
            await handle.runner.restore(
                snapshot.chunks,
                session_id=session_id,
                sha256=snapshot.info.sha256,
                timeout_s=timeout_s,
                taken_of=taken_of,
            )

    async def stored(self, session_id: str) -> list[StoredCheckpoint]:
        """The session's checkpoint objects, oldest generation first (old keys count as 0)."""
        # One listing covers both schemes: "checkpoints/<rt>/…" and "checkpoints/<rt>.tar.gz".
        entries = await self.store.list(checkpoint_prefix(session_id).rstrip("/"))
        return _checkpoints(session_id, entries)

    @staticmethod
    def latest(checkpoints: Sequence[StoredCheckpoint]) -> StoredCheckpoint | None:
        """The newest of ``checkpoints`` (what ``stored`` listed): the highest generation."""
        restorable = (item for item in checkpoints if item.restorable)
        return max(restorable, key=lambda item: item.generation, default=None)

    async def collect(
        self,
        session_id: str,
        checkpoints: Sequence[StoredCheckpoint],
        *,
        keep: str | None,
        below_generation: int,
    ) -> int:
        """Delete the session's superseded objects: returns how many went.

        An object goes when it is not ``keep`` (the record's pointer), its writer's
        generation is below ``below_generation`` (so its holder was superseded and
        no fenced record can ever point at it) and it is older than the grace
        period (a reader restoring it, or a writer in another embedded process,
        has had time to finish). Best effort: a failed delete is logged, and the
        next collection tries again.
        """
        cutoff = self._now() - self.grace_s
        deleted = 0
        for item in checkpoints:
            if item.key == keep or item.generation >= below_generation:
                continue
            if item.modified_at_s > cutoff:
                continue
            # The result first: a checkpoint left without one is collected next
            # time, a result left without its checkpoint would never be.
            deleted += await collect_key(self.store, item.key, before=item.result_key)
        return deleted

    async def delete_all(self, session_id: str, *, also: str | None = None) -> None:
        """Delete every checkpoint object of the session (and ``also``, a record's old key)."""
        entries = await self.store.list(checkpoint_prefix(session_id).rstrip("/"))
        # Everything under the session's prefix: checkpoints, turn results, and a
        # result whose checkpoint is already gone.
        prefix = checkpoint_prefix(session_id)
        keys = {e.key for e in entries if e.key.startswith(prefix)}
        keys |= {item.key for item in _checkpoints(session_id, entries)}
        keys.add(legacy_checkpoint_key(session_id))
        if also is not None:
            keys.add(also)
        for key in sorted(keys):
            await self.store.delete(key)


def _checkpoints(session_id: str, entries: Sequence[SnapshotEntry]) -> list[StoredCheckpoint]:
    legacy = legacy_checkpoint_key(session_id)
    results: dict[str, tuple[str, str]] = {}
    for entry in entries:
        checkpoint, mark, turn_key = entry.key.partition(_TURN_MARK)
        if mark and turn_key:
            results[checkpoint] = (turn_key, entry.key)
    found: list[StoredCheckpoint] = []
    for entry in entries:
        parsed = parse_checkpoint_key(entry.key)
        if parsed is not None and parsed[0] == session_id:
            turn = results.pop(entry.key, None)
            found.append(
                StoredCheckpoint(
                    entry.key,
                    parsed[1],
                    entry.modified_at_s,
                    turn_key=turn[0] if turn else None,
                    result_key=turn[1] if turn else None,
                )
            )
        elif entry.key == legacy:
            found.append(StoredCheckpoint(entry.key, 0, entry.modified_at_s))
    modified = {entry.key: entry.modified_at_s for entry in entries}
    answers = checkpoint_prefix(session_id) + _ANSWER_MARK
    for entry in entries:
        if entry.key.startswith(answers):
            # Generation 0: below every holder's, so collected once past the grace.
            found.append(
                StoredCheckpoint(
                    entry.key,
                    0,
                    entry.modified_at_s,
                    turn_key=entry.key[len(answers) :],
                    restorable=False,
                )
            )
    for checkpoint, (turn_key, result_key) in results.items():
        parsed = parse_checkpoint_key(checkpoint)
        if parsed is not None and parsed[0] == session_id:
            found.append(
                StoredCheckpoint(
                    result_key,
                    parsed[1],
                    modified[result_key],
                    turn_key=turn_key,
                    restorable=False,
                )
            )
    return sorted(found, key=lambda item: (item.generation, item.key))
