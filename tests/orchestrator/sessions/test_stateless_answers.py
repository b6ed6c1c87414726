"""The sweep of keyed stateless runs' saved answers (``answers/<key>``) is bounded.

Their keys are hashes, so no listing can be cut to the expired ones; each sweep used to
list the whole prefix (every answer of a grace period, a request per thousand on S3)
to delete at most a page of them. Now a sweep reads one page, from where the previous
one stopped, and wraps at the end: every answer is still looked at, and an expired one
deleted, within a few rounds. Real stores: a directory and moto's S3.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

from sandcell_orchestrator.sessions.stateless_answers import (
    STATELESS_ANSWERS_PREFIX,
    StatelessAnswer,
    StatelessAnswers,
)
from sandcell_orchestrator.snapshots import SnapshotEntry, SnapshotStore

PAGE = 3


class _CountingLists:
    """The store, remembering how many keys each listing of ``answers/`` returned."""

    def __init__(self, inner: SnapshotStore) -> None:
        self._inner = inner
        self.listed: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def list(self, prefix: str, **page: Any) -> list[SnapshotEntry]:
        found: list[SnapshotEntry] = await self._inner.list(prefix, **page)
        if prefix == STATELESS_ANSWERS_PREFIX:
            self.listed.append(len(found))
        return found


def stored_key(n: int) -> str:
    return hashlib.sha256(f"answer-{n}".encode()).hexdigest()


async def saved(store: SnapshotStore) -> list[str]:
    return [entry.key for entry in await store.list(STATELESS_ANSWERS_PREFIX)]


async def test_each_sweep_looks_at_one_page_and_the_next_resumes(store: SnapshotStore) -> None:
    """Seven expired answers, pages of three: each round lists at most three keys and
    deletes them; the rounds go on from where the last stopped until none is left."""
    clock = [time.time() + 3600]
    answers = StatelessAnswers(store, grace_s=60, wall_clock=lambda: clock[0])
    for n in range(7):
        await answers.put_result(stored_key(n), StatelessAnswer("f", 200, b"{}"))
    counting = _CountingLists(store)
    answers.store = counting  # type: ignore[assignment]

    deleted = [await answers.collect_older(limit=PAGE) for _ in range(3)]

    assert deleted == [3, 3, 1]
    assert counting.listed == [3, 3, 1]
    assert await saved(store) == []


async def test_fresh_answers_stay_and_go_once_past_the_grace_whatever_the_cursor(
    store: SnapshotStore,
) -> None:
    """Within the grace period nothing goes, however many rounds pass over the answers
    (the cursor wraps); once past it, every answer goes within ceil(answers / page) + 1
    rounds, each round listing at most a page."""
    clock = [time.time()]
    answers = StatelessAnswers(store, grace_s=600, wall_clock=lambda: clock[0])
    keys = sorted(f"{STATELESS_ANSWERS_PREFIX}{stored_key(n)}" for n in range(8))
    for n in range(8):
        await answers.put_result(stored_key(n), StatelessAnswer("f", 200, b"{}"))
    counting = _CountingLists(store)
    answers.store = counting  # type: ignore[assignment]

    for _ in range(5):  # past the end and round again
        assert await answers.collect_older(limit=PAGE) == 0
    assert await saved(store) == keys

    clock[0] += 601
    rounds = math.ceil(len(keys) / PAGE) + 1
    deleted = sum([await answers.collect_older(limit=PAGE) for _ in range(rounds)])
    assert deleted == len(keys)
    assert await saved(store) == []
    assert max(counting.listed) <= PAGE
