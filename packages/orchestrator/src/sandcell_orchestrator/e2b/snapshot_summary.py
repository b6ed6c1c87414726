"""``SnapshotSummary``: what a listing shows of an E2B snapshot, and its index entry.

A snapshot's index entry is an empty object whose key's last component holds its
summary (``saved.py`` says where it lives and when it is written):

    <id>C<µs>S<sandbox id>T<tag>[N<name>]

the separators capitals, which no id, name or tag has; a summary whose component
would pass a key's length has no entry (it is listed from its meta).
"""

from __future__ import annotations

import re

import msgspec

__all__ = ["INDEX_PREFIX", "SNAPSHOT_TAG", "SnapshotSummary"]

SNAPSHOT_TAG = "default"
"""The tag of every snapshot id on the wire (``<id>:default``)."""

INDEX_PREFIX = "e2b-snapshot-index/"
"""Where index entries live: ``<prefix><sha256 of the namespace>/<component>``."""

_INDEX_RE = re.compile(
    r"(?P<id>[a-z0-9]{20})C(?P<us>[0-9]{1,20})S(?P<sandbox>[a-z0-9]{20})"
    r"T(?P<tag>[a-z0-9_.-]+?)(?:N(?P<name>[a-z0-9_-]+))?"
)
_INDEX_KEY_MAX = 255


class SnapshotSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a listing shows of a snapshot, and what names and filters go by."""

    snapshot_id: str
    namespace: str
    sandbox_id: str
    created_at_us: int
    """When it was taken, in whole microseconds (the listing's order and its tokens)."""
    name: str | None = None
    tag: str = SNAPSHOT_TAG

    def ref(self, slug: str) -> str:
        """The id on the wire: ``<id>:default``, or ``<slug>/<name>:<tag>`` when named."""
        if self.name is None:
            return f"{self.snapshot_id}:{SNAPSHOT_TAG}"
        return f"{slug}/{self.name}:{self.tag}"

    def names(self, slug: str) -> list[str]:
        """E2B's ``names``: ``[<slug>/<name>]`` when named, else none."""
        return [] if self.name is None else [f"{slug}/{self.name}"]

    def index_name(self) -> str | None:
        """The index entry's last key component; None if it would not fit one (a very
        long name: the snapshot is then listed from its meta)."""
        raw = f"{self.snapshot_id}C{self.created_at_us}S{self.sandbox_id}T{self.tag}"
        if self.name is not None:
            raw += f"N{self.name}"
        return raw if len(raw) <= _INDEX_KEY_MAX and _INDEX_RE.fullmatch(raw) else None

    @classmethod
    def from_index(cls, namespace: str, component: str) -> SnapshotSummary | None:
        """The summary an index key's last component holds; None if it holds none."""
        found = _INDEX_RE.fullmatch(component)
        if found is None:
            return None
        return cls(
            snapshot_id=found["id"],
            namespace=namespace,
            sandbox_id=found["sandbox"],
            created_at_us=int(found["us"]),
            name=found["name"],
            tag=found["tag"],
        )
