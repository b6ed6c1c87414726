"""``MetricsHistory``: a paused sandbox's metrics samples, kept past its runner.

The samples are the runner's (a bounded ring, ``runner/sandbox/metrics.py``); a
pause that checkpoints and destroys the sandbox would lose them, where E2B keeps a
sandbox's metrics. So a pause copies the ring, merged with what earlier pauses kept,
into the snapshot store under the tenant's own prefix:

    e2b-metrics/<sha256 of the namespace>/<sandbox id>    [MetricsSample] JSON

at most ``MAX_SAMPLES`` (the ring's size), newest kept. ``get_metrics`` answers
these merged with the live ring's; a kill deletes them. Best effort: a sample the
store could not take is lost, never a pause.
"""

from __future__ import annotations

import logging
import math

import msgspec

from sandcell_protocol.sandbox_messages import MetricsQuery, MetricsSample

from ..errors import SandcellError
from ..snapshots import SnapshotNotFoundError, SnapshotStore
from ..snapshots.whole import put_whole, read_whole
from ..tenants import tenant_digest

__all__ = ["MAX_SAMPLES", "MetricsHistory", "in_range", "merge_samples"]

log = logging.getLogger(__name__)

MAX_SAMPLES = 720
"""Samples kept per sandbox: the runner's ring holds as many (an hour at 5 s)."""

_PREFIX = "e2b-metrics/"
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

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"MetricsHistory({self.store!r})"

    @staticmethod
    def key(namespace: str, sandbox_id: str) -> str:
        """Where ``namespace``'s sandbox's samples are kept."""
        return f"{_PREFIX}{tenant_digest(namespace)}/{sandbox_id}"

    async def read(self, namespace: str, sandbox_id: str) -> list[MetricsSample]:
        """The kept samples, oldest first; none if none (or unreadable: logged)."""
        try:
            raw = await read_whole(
                self.store, self.key(namespace, sandbox_id), max_bytes=_MAX_BYTES
            )
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
