"""``StatelessAnswers``: the snapshot store's copy of keyed stateless runs' answers.

A keyed stateless run (an ``Idempotency-Key``, no session: nothing to restore, no
checkpoint to carry a result) has its answer only in the registry, and a registry
that forgot everything (a Redis without persistence, wiped) would let its retry run
it a second time. So the run also saves its answer here, before it answers, and a
retry the registry has no claim for reads it first (``serve/idempotency.py`` decides
when; this module only keeps the objects):

    answers/<stored key>    {fingerprint, status, body} of one keyed stateless run

The stored key is the idempotency key as the registry stores it: a hash of surface,
tenant and header, so tenants never meet and nothing a client sends becomes a key.
The prefix is its own, beside ``checkpoints/`` and ``inputs/``, so no session's
listing or collection sees these objects. Nothing points at them, so they are
collected by age alone once older than the grace period (``collect_older``, the
sweeper's), which is the checkpoints' grace (``SANDCELL_CHECKPOINT_GRACE_S``).

Their keys are hashes, in no order of age, so no listing can be cut to the expired
ones; instead each sweep reads one page of the prefix, from where the last sweep of
this process stopped (S3's ``start-after``), deletes what is past the grace there,
and starts again at the beginning once a page comes back short. Each round costs one
listing request, whatever the prefix holds; each answer is looked at once every
``ceil(answers / page)`` rounds, so one expired is deleted that many rounds late at
most (as long as fewer answers are made a round than a page holds, which was already
the bound on deletes a round).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import msgspec

from ..errors import CheckpointError
from ..snapshots import SnapshotNotFoundError, SnapshotStore
from ..snapshots.collection import collect_key
from ..snapshots.whole import put_whole, read_whole
from ..stored import StoredDecoder

__all__ = [
    "STATELESS_ANSWERS_PREFIX",
    "StatelessAnswer",
    "StatelessAnswers",
    "stateless_answer_key",
]

STATELESS_ANSWERS_PREFIX = "answers/"
_STORED_KEY = re.compile(r"[0-9a-f]{64}")
_ANSWER_MAX_BYTES = 64 << 20
"""An answer is a job's captured output: the runner's own caps keep it far below."""


def stateless_answer_key(stored_key: str) -> str:
    """The object key of the keyed stateless run ``stored_key``'s answer (a stored
    idempotency key: 64 hex digits, never what a client sent)."""
    if not _STORED_KEY.fullmatch(stored_key):
        raise ValueError("a stored idempotency key is 64 hex digits")
    return f"{STATELESS_ANSWERS_PREFIX}{stored_key}"


class StatelessAnswer(msgspec.Struct, frozen=True):
    """A keyed stateless run's answer as the store keeps it."""

    fingerprint: str
    """The request body's sha256: another body with the key is still a 422."""
    status: int
    body: bytes


_ANSWER_DECODER = StoredDecoder(StatelessAnswer)


class StatelessAnswers:
    """Keyed stateless runs' answers under ``answers/`` of one ``SnapshotStore``."""

    def __init__(
        self,
        store: SnapshotStore,
        *,
        grace_s: float = 600.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.grace_s = grace_s
        self._now = wall_clock
        self._cursor: str | None = None
        """The last key the previous sweep looked at; None: start at the beginning."""

    def __repr__(self) -> str:
        return f"StatelessAnswers({self.store!r})"

    async def put_result(self, stored_key: str, answer: StatelessAnswer) -> None:
        """Store the answer of the keyed stateless run ``stored_key`` (``CheckpointError``
        if the store failed)."""
        await put_whole(
            self.store,
            stateless_answer_key(stored_key),
            msgspec.json.encode(answer),
            max_bytes=_ANSWER_MAX_BYTES,
        )

    async def read_result(self, stored_key: str) -> StatelessAnswer | None:
        """The saved answer of the keyed stateless run ``stored_key``; None: none saved.

        ``CheckpointError`` if the store failed or the object is not an answer: the
        caller cannot tell whether the run was answered.
        """
        key = stateless_answer_key(stored_key)
        try:
            raw = await read_whole(self.store, key, max_bytes=_ANSWER_MAX_BYTES)
        except SnapshotNotFoundError:
            return None
        try:
            return _ANSWER_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"{key} does not hold a saved answer") from exc

    async def collect_older(self, *, limit: int) -> int:
        """Look at the next ``limit`` saved answers (one page of the prefix, after the
        last sweep's) and delete those older than the grace period; returns how many
        went. Best effort: a failed delete is logged and the object kept for the next
        time round."""
        cutoff = self._now() - self.grace_s
        page = await self.store.list(
            STATELESS_ANSWERS_PREFIX, start_after=self._cursor, limit=limit
        )
        # A short page reached the end: the next sweep starts from the beginning.
        self._cursor = page[-1].key if len(page) == limit else None
        deleted = 0
        for entry in page:
            if entry.modified_at_s <= cutoff:
                deleted += await collect_key(self.store, entry.key)
        return deleted
