"""``MetricsHistory``: a paused sandbox's metrics samples, kept past its runner.

The samples are the runner's (a bounded ring, ``runner/sandbox/metrics.py``); a
pause that checkpoints and destroys the sandbox would lose them, where E2B keeps a
sandbox's metrics. So a pause copies the ring, merged with what earlier pauses kept,
into the snapshot store under the tenant's own prefix:

    e2b-metrics/<sha256 of the namespace>/<sandbox id>    [MetricsSample] JSON

at most ``MAX_SAMPLES`` (the ring's size), newest kept. ``get_metrics`` answers
these merged with the live ring's. Best effort: a sample the store could not take
is lost, never a pause.

A kill retires a sandbox's samples (the runner's last ring merged with the kept
ones), as E2B keeps a killed sandbox's metrics in its metrics store:

    e2b-metrics-killed/<sha256 of the namespace>/<sandbox id>    [MetricsSample] JSON

answered by ``get_metrics`` after the sandbox is gone. Bounded in time and count:
samples older than ``RETAIN_KILLED_S`` are not answered (E2B's metrics tables
drop rows 7 days after their timestamp), each kill deletes its tenant's retired
objects past the newest ``MAX_KILLED_PER_TENANT`` or older than that, and an
hourly sweep (``reap_expired``) deletes every tenant's older ones (a tenant that
kills no more sandboxes).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import msgspec

from sandcell_protocol.sandbox_messages import MetricsQuery, MetricsSample

from ..errors import SandcellError
from ..snapshots import SnapshotNotFoundError, SnapshotStore
from ..snapshots.whole import put_whole, read_whole
from ..tenants import tenant_digest

__all__ = [
    "MAX_KILLED_PER_TENANT",
    "MAX_SAMPLES",
    "RETAIN_KILLED_S",
    "MetricsHistory",
    "in_range",
    "merge_samples",
]

log = logging.getLogger(__name__)

MAX_SAMPLES = 720
"""Samples kept per sandbox: the runner's ring holds as many (an hour at 5 s)."""

RETAIN_KILLED_S = 7 * 86_400
"""How long a killed sandbox's samples answer (E2B's metrics TTL: 7 days)."""

MAX_KILLED_PER_TENANT = 100
"""Killed sandboxes whose samples a tenant's store prefix keeps, newest first."""

_REAP_PAGE = 1000
_PREFIX = "e2b-metrics/"
_KILLED_PREFIX = "e2b-metrics-killed/"
# A sample is under 300 bytes of JSON.
_MAX_BYTES = MAX_SAMPLES * 512
_DECODER = msgspec.json.Decoder(list[MetricsSample])


def merge_samples(*parts: list[MetricsSample]) -> list[MetricsSample]:
    """The samples of ``parts``, oldest first, one per instant (a MicroVM suspended in
    place keeps its ring, so a kept sample can come back live), the newest
    ``MAX_SAMPLES``."""
    by_time = {sample.at_s: sample for part in parts for sample in part}
    return [by_time[at] for at in sorted(by_time)][-MAX_SAMPLES:]


def in_range(samples: list[MetricsSample], query: MetricsQuery) -> list[MetricsSample]:
    """The samples in the query's whole-second range, as the runner filters its ring."""
    low = query.start_s if query.start_s is not None else -math.inf
    high = query.end_s if query.end_s is not None else math.inf
    return [s for s in samples if low <= math.floor(s.at_s) <= high]


class MetricsHistory:
    """Paused sandboxes' samples in ``store``, each under its tenant's prefix."""

    def __init__(
        self,
        store: SnapshotStore,
        *,
        max_killed: int = MAX_KILLED_PER_TENANT,
        retain_killed_s: float = RETAIN_KILLED_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.max_killed = max_killed
        self.retain_killed_s = retain_killed_s
        self._now = wall_clock

    def __repr__(self) -> str:
        return f"MetricsHistory({self.store!r})"

    @staticmethod
    def key(namespace: str, sandbox_id: str) -> str:
        """Where ``namespace``'s sandbox's samples are kept."""
        return f"{_PREFIX}{tenant_digest(namespace)}/{sandbox_id}"

    @staticmethod
    def killed_key(namespace: str, sandbox_id: str) -> str:
        """Where ``namespace``'s killed sandbox's samples are retired."""
        return f"{_KILLED_PREFIX}{tenant_digest(namespace)}/{sandbox_id}"

    async def read(self, namespace: str, sandbox_id: str) -> list[MetricsSample]:
        """The kept samples, oldest first; none if none (or unreadable: logged)."""
        return await self._read(self.key(namespace, sandbox_id), sandbox_id)

    async def read_killed(self, namespace: str, sandbox_id: str) -> list[MetricsSample]:
        """The retired samples of ``namespace``'s killed sandbox not older than the
        retention, oldest first; none for a sandbox it never had (another tenant's
        included: its own prefix is read)."""
        oldest = self._now() - self.retain_killed_s
        samples = await self._read(self.killed_key(namespace, sandbox_id), sandbox_id)
        return [s for s in samples if s.at_s >= oldest]

    async def _read(self, key: str, sandbox_id: str) -> list[MetricsSample]:
        try:
            raw = await read_whole(self.store, key, max_bytes=_MAX_BYTES)
            return _DECODER.decode(raw)
        except SnapshotNotFoundError:
            return []
        except (SandcellError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("e2b sandbox %s: kept metrics unreadable: %s", sandbox_id, exc)
            return []

    async def keep(self, namespace: str, sandbox_id: str, samples: list[MetricsSample]) -> None:
        """Add ``samples`` to the kept ones (merged, bounded); a failure is logged."""
        if not samples:
            return
        merged = merge_samples(await self.read(namespace, sandbox_id), samples)
        try:
            await put_whole(
                self.store,
                self.key(namespace, sandbox_id),
                msgspec.json.encode(merged),
                max_bytes=_MAX_BYTES,
            )
        except SandcellError as exc:
            log.warning("e2b sandbox %s: its metrics were not kept: %s", sandbox_id, exc)

    async def drop(self, namespace: str, sandbox_id: str) -> None:
        """Delete the kept samples (none is fine); a failure is logged."""
        try:
            await self.store.delete(self.key(namespace, sandbox_id))
        except SandcellError as exc:
            log.warning("e2b sandbox %s: kept metrics not deleted: %s", sandbox_id, exc)

    async def retire(self, namespace: str, sandbox_id: str, samples: list[MetricsSample]) -> None:
        """At a kill: ``samples`` (its runner's last) with the kept ones, retired under
        the killed prefix; then the tenant's retired objects past the count or time
        bound are deleted. Best effort: a failure is logged, never the kill's."""
        merged = merge_samples(await self.read(namespace, sandbox_id), samples)
        if merged:
            try:
                await put_whole(
                    self.store,
                    self.killed_key(namespace, sandbox_id),
                    msgspec.json.encode(merged),
                    max_bytes=_MAX_BYTES,
                )
            except SandcellError as exc:
                log.warning("e2b sandbox %s: its metrics were not retired: %s", sandbox_id, exc)
        await self.reap_killed(namespace)

    async def reap_killed(self, namespace: str) -> int:
        """Delete ``namespace``'s retired samples past the newest ``max_killed`` or
        written longer than the retention ago; how many (a failure is logged)."""
        prefix = f"{_KILLED_PREFIX}{tenant_digest(namespace)}/"
        oldest = self._now() - self.retain_killed_s
        try:
            entries = await self.store.list(prefix)
            entries.sort(key=lambda entry: entry.modified_at_s, reverse=True)
            stale = [
                entry
                for rank, entry in enumerate(entries)
                if rank >= self.max_killed or entry.modified_at_s < oldest
            ]
            for entry in stale:
                await self.store.delete(entry.key)
        except SandcellError as exc:
            log.warning("e2b: retired metrics of a tenant not reaped: %s", exc)
            return 0
        return len(stale)

    async def reap_expired(self) -> int:
        """Delete every tenant's retired samples written longer than the retention ago,
        a page of the listing at a time; how many (store errors raise)."""
        oldest = self._now() - self.retain_killed_s
        reaped = 0
        after: str | None = None
        while True:
            page = await self.store.list(_KILLED_PREFIX, start_after=after, limit=_REAP_PAGE)
            for entry in page:
                if entry.modified_at_s < oldest:
                    await self.store.delete(entry.key)
                    reaped += 1
            if len(page) < _REAP_PAGE:
                return reaped
            after = page[-1].key
