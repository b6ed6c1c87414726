"""``SavedSnapshots``: E2B snapshots, a running sandbox's workspace kept under an id
its tenant owns, to create sandboxes from (``Sandbox.create(snapshot_id)``).

A snapshot is three objects in the snapshot store, under its tenant's own prefixes:

    e2b-snapshots/<sha256 of the namespace>/<id>        SnapshotMeta JSON
    e2b-snapshot-index/<sha256 of the namespace>/<id>C<µs>S<sandbox id>T<tag>[N<name>]
                                                        empty: the key is the summary
    e2b-snapshot-data/<sha256 of the namespace>/<id>    the workspace (a checkpoint)

The workspace is written first and the meta after it, so a meta never names a
missing workspace; a delete removes the meta first (from then on the id is
unknown), then the workspace, and the index entry last. The index entry's key holds what a
listing shows and filters by (``SnapshotSummary``; the separators are capitals, which
no id, name or tag has), so a listing is two store listings and no reads: the metas'
keys say which snapshots exist, the index keys what they are. A meta without an entry
(written by an orchestrator before the index, or whose entry's write failed) is read
and its entry written then. An entry without a meta is a delete cut short (an entry
is written only after its meta, and removed last): it is not shown, and the listing
that finds it finishes the delete (the workspace, then the entry), once the meta is
checked gone (it may have been written after the metas were listed).
Neither is a session's checkpoint, so the session
collector never touches them and they outlive the sandbox they were taken of (as
E2B's do). A lookup reads the caller's own prefix only, so another tenant's
snapshot id answers exactly as an unknown one (DESIGN rule 8); a listing is one
store listing of that prefix, bounded by the per-tenant cap.

On the wire a snapshot id is ``<id>:default`` (E2B's ``<template id>:<tag>``);
the bare ``<id>`` is taken too. A named snapshot (``create_snapshot(name=)``) is
one too, its meta carrying the name and tag; on the wire it is
``<team slug>/<name>:<tag>`` (E2B's), the slug the tenant's namespace made a valid
E2B namespace (``team_slug``). A name is no object of its own: the tenant's metas
(at most the cap) are read to resolve one, and a new snapshot under a name and tag
deletes the older ones under them after it is written, so of two racing the newer
is left (E2B's build assigned to an existing template's tag).

The cap holds under concurrent snapshots: a worker claims a place before it copies
a workspace (its own snapshots being taken count, so two of its requests never
both take the last place), and counts again once the meta is written, so two
workers that both took the last place do not both keep it (``add`` answers False
and removes the one it wrote).
"""

from __future__ import annotations

import collections
import logging
import re

import anyio
import msgspec

from ..errors import CheckpointError
from ..snapshots import SnapshotNotFoundError, SnapshotStore
from ..snapshots.whole import put_whole, read_whole
from ..tenants import tenant_digest
from .sandbox import valid_sandbox_id
from .snapshot_summary import INDEX_PREFIX, SNAPSHOT_TAG, SnapshotSummary

__all__ = [
    "NAME_MAX_CHARS",
    "SNAPSHOT_TAG",
    "SavedSnapshots",
    "SnapshotMeta",
    "SnapshotName",
    "SnapshotSummary",
    "parse_snapshot_name",
    "snapshot_ref",
    "team_slug",
]

log = logging.getLogger(__name__)

NAME_MAX_CHARS = 128
"""The longest name (alias) and the longest tag a new snapshot may be taken under: its
meta then stays far inside ``_META_MAX_BYTES`` (an index entry's key may still not
hold both at their longest: that snapshot is listed from its meta)."""

_META_PREFIX = "e2b-snapshots/"
_DATA_PREFIX = "e2b-snapshot-data/"
_META_MAX_BYTES = 64 << 10
# E2B's id package: an alias and a namespace, and a tag.
_IDENTIFIER_RE = re.compile(r"[a-z0-9_-]+")
_TAG_RE = re.compile(r"[a-z0-9_.-]+")
_SLUG_DROPPED_RE = re.compile(r"[^a-z0-9_-]")


class SnapshotMeta(msgspec.Struct, frozen=True, kw_only=True):
    """One snapshot: whose it is, what it was taken of, and the template it runs as."""

    snapshot_id: str
    namespace: str
    template: str
    """The source sandbox's template: a sandbox created from the snapshot runs its spec."""
    sandbox_id: str
    session_id: str
    """The source's session: the workspace archive names it (the restore says so)."""
    created_at_s: float
    name: str | None = None
    """The alias a named snapshot was taken under (no namespace); None for unnamed."""
    tag: str = SNAPSHOT_TAG
    """A named snapshot's tag (``default`` unless the name gave one)."""

    def summary(self) -> SnapshotSummary:
        """What the listing shows of it (``SnapshotSummary``)."""
        return SnapshotSummary(
            snapshot_id=self.snapshot_id,
            namespace=self.namespace,
            sandbox_id=self.sandbox_id,
            created_at_us=round(self.created_at_s * 1_000_000),
            name=self.name,
            tag=self.tag,
        )


class SnapshotName(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed E2B name: ``[<namespace>/]<alias>[:<tag>]``, lowercased and trimmed."""

    namespace: str | None
    alias: str
    tag: str | None
    """None when the name gave no tag, or gave ``default`` (E2B's ParseName)."""
    tagged: bool
    """Whether the name had a ``:`` at all (a listing's ``name:default`` filters by tag)."""


def _clean(value: str, what: str, pattern: re.Pattern[str]) -> str:
    cleaned = value.strip().lower()
    if not pattern.fullmatch(cleaned):
        raise ValueError(f"invalid {what}: {value[:80]}")
    return cleaned


def parse_snapshot_name(raw: str) -> SnapshotName:
    """E2B's ``id.ParseName``; ``ValueError`` with E2B's text for an invalid one."""
    identifier, colon, tag = raw.strip().partition(":")
    namespace, slash, alias = identifier.partition("/")
    if not slash:
        namespace, alias = "", identifier
    parsed_tag = _clean(tag, "tag", _TAG_RE) if colon else None
    return SnapshotName(
        namespace=_clean(namespace, "namespace", _IDENTIFIER_RE) if slash else None,
        alias=_clean(alias, "template ID", _IDENTIFIER_RE),
        tag=None if parsed_tag == SNAPSHOT_TAG else parsed_tag,
        tagged=bool(colon),
    )


def team_slug(namespace: str) -> str:
    """The E2B namespace (team slug) of a tenant: its namespace lowercased, with ``.``
    and ``:`` (which E2B's namespaces lack) as ``-``. Two tenants may share a slug;
    it only names, and every lookup goes by the tenant itself."""
    return _SLUG_DROPPED_RE.sub("-", namespace.lower())


def snapshot_ref(raw: str) -> str | None:
    """The bare id of a wire snapshot id (``<id>:default`` or ``<id>``); None if it
    cannot be one this service handed out."""
    bare, colon, tag = raw.partition(":")
    if colon and tag != SNAPSHOT_TAG:
        return None
    return bare if valid_sandbox_id(bare) else None


class SavedSnapshots:
    """Snapshots' metadata and workspaces in ``store``; at most ``max_per_tenant`` each."""

    def __init__(self, store: SnapshotStore, *, max_per_tenant: int) -> None:
        self.store = store
        self.max_per_tenant = max_per_tenant
        # Per tenant: snapshots this worker is taking (claimed, meta not yet written),
        # and the lock that makes a claim's count and increment one step. Tenants are
        # the configured API keys' namespaces, a fixed few: the locks are kept.
        self._taking: collections.Counter[str] = collections.Counter()
        self._claim_locks: dict[str, anyio.Lock] = {}

    def __repr__(self) -> str:
        return f"SavedSnapshots({self.store!r})"

    @staticmethod
    def data_key(namespace: str, snapshot_id: str) -> str:
        """Where the snapshot's workspace lives."""
        return f"{_DATA_PREFIX}{tenant_digest(namespace)}/{snapshot_id}"

    @staticmethod
    def _meta_prefix(namespace: str) -> str:
        return f"{_META_PREFIX}{tenant_digest(namespace)}/"

    async def ids(self, namespace: str) -> list[str]:
        """``namespace``'s snapshot ids, by id; at most one past the cap (one listing)."""
        prefix = self._meta_prefix(namespace)
        entries = await self.store.list(prefix, limit=self.max_per_tenant + 1)
        ids = [entry.key.removeprefix(prefix) for entry in entries]
        return [i for i in ids if snapshot_ref(i) == i]

    async def has_room(self, namespace: str) -> bool:
        """Whether ``namespace`` may take one more snapshot (counting those this worker
        is taking)."""
        taking = self._taking[namespace]
        return len(await self.ids(namespace)) + taking < self.max_per_tenant

    async def claim(self, namespace: str) -> bool:
        """Take one of ``namespace``'s places for a snapshot about to be taken; False
        when none is left. ``unclaim`` gives it back once the meta is written (``add``)
        or the snapshot failed."""
        lock = self._claim_locks.setdefault(namespace, anyio.Lock())
        async with lock:
            if not await self.has_room(namespace):
                return False
            self._taking[namespace] += 1
        return True

    def unclaim(self, namespace: str) -> None:
        """Give back a place ``claim`` took."""
        self._taking[namespace] -= 1
        if self._taking[namespace] <= 0:
            del self._taking[namespace]

    async def get(self, namespace: str, snapshot_id: str) -> SnapshotMeta | None:
        """``namespace``'s snapshot ``snapshot_id`` (bare); None if it has none so named."""
        try:
            raw = await read_whole(
                self.store,
                self._meta_prefix(namespace) + snapshot_id,
                max_bytes=_META_MAX_BYTES,
            )
        except SnapshotNotFoundError:
            return None
        try:
            meta = msgspec.json.decode(raw, type=SnapshotMeta)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("e2b snapshot %s: unreadable metadata; skipping it", snapshot_id)
            return None
        if meta.snapshot_id != snapshot_id or meta.namespace != namespace:
            return None
        return meta

    @staticmethod
    def _index_prefix(namespace: str) -> str:
        return f"{INDEX_PREFIX}{tenant_digest(namespace)}/"

    def _index_key(self, summary: SnapshotSummary) -> str | None:
        component = summary.index_name()
        return None if component is None else self._index_prefix(summary.namespace) + component

    async def _index(self, summary: SnapshotSummary) -> None:
        """Write ``summary``'s index entry; a failure is logged (the snapshot is then
        listed from its meta, and its entry written by that listing)."""
        key = self._index_key(summary)
        if key is None:
            return
        try:
            await put_whole(self.store, key, b"", max_bytes=0)
        except CheckpointError as exc:
            log.warning("e2b snapshot %s: index entry not written: %s", summary.snapshot_id, exc)

    async def summaries(self, namespace: str) -> list[SnapshotSummary]:
        """All of ``namespace``'s snapshots as listings show them: two store listings
        (the metas' keys, the index's), plus a read of each meta that has no index
        entry (then written)."""
        ids = await self.ids(namespace)
        prefix = self._index_prefix(namespace)
        # Entries without a meta (a delete cut short) may add to the cap's: twice it.
        entries = await self.store.list(prefix, limit=2 * (self.max_per_tenant + 1))
        indexed: dict[str, SnapshotSummary] = {}
        for entry in entries:
            summary = SnapshotSummary.from_index(namespace, entry.key.removeprefix(prefix))
            if summary is not None:
                indexed[summary.snapshot_id] = summary
        known = set(ids)
        for snapshot_id, summary in list(indexed.items()):
            if snapshot_id not in known and await self._reap_if_deleted(summary):
                del indexed[snapshot_id]
        found: list[SnapshotSummary] = []
        for snapshot_id in ids:
            summary = indexed.get(snapshot_id)
            if summary is None:
                meta = await self.get(namespace, snapshot_id)
                if meta is None:
                    continue
                summary = meta.summary()
                await self._index(summary)
            found.append(summary)
        return found

    async def named(
        self, namespace: str, name: str, tag: str | None = None
    ) -> list[SnapshotSummary]:
        """``namespace``'s snapshots taken under ``name`` (of ``tag`` if given), newest
        first."""
        found = [
            m
            for m in await self.summaries(namespace)
            if m.name == name and (tag is None or m.tag == tag)
        ]
        return sorted(found, key=lambda m: (m.created_at_us, m.snapshot_id), reverse=True)

    async def supersede(self, meta: SnapshotMeta) -> None:
        """Delete the snapshots under ``meta``'s name and tag older than it: a name and
        tag name one snapshot, the newest (E2B moves the tag to the new build)."""
        if meta.name is None:
            return
        newest = meta.summary()
        for older in await self.named(meta.namespace, meta.name, meta.tag):
            if (older.created_at_us, older.snapshot_id) < (
                newest.created_at_us,
                newest.snapshot_id,
            ):
                await self.delete(meta.namespace, older.snapshot_id)

    async def add(self, meta: SnapshotMeta) -> bool:
        """Write ``meta`` (its workspace is written already). False when its tenant is
        now past the cap (another worker's snapshot took the last place meanwhile): both
        are deleted again. On a failure the workspace is deleted and ``CheckpointError``
        raised."""
        key = self._meta_prefix(meta.namespace) + meta.snapshot_id
        try:
            await put_whole(self.store, key, msgspec.json.encode(meta), max_bytes=_META_MAX_BYTES)
        except CheckpointError:
            await self.store.delete(self.data_key(meta.namespace, meta.snapshot_id))
            raise
        try:
            kept = len(await self.ids(meta.namespace))
        except CheckpointError as exc:
            # The place was claimed before the copy: a recount the store cannot answer
            # keeps the snapshot (failing here would leave a listed snapshot whose
            # caller was told it failed).
            log.warning("e2b snapshot %s: kept uncounted: %s", meta.snapshot_id, exc)
            await self._index(meta.summary())
            return True
        if kept <= self.max_per_tenant:
            await self._index(meta.summary())
            return True
        # Two workers that raced for the last place may both give theirs up: the cap
        # holds either way, and the callers are told to retry.
        with anyio.CancelScope(shield=True):
            await self.store.delete(key)
            await self.store.delete(self.data_key(meta.namespace, meta.snapshot_id))
        return False

    async def delete(self, namespace: str, snapshot_id: str) -> bool:
        """Delete ``namespace``'s snapshot: its meta, then its workspace, then its index
        entry (left, it is what a listing finishes a cut-short delete from); False if
        none."""
        meta = await self.get(namespace, snapshot_id)
        if meta is None:
            return False
        await self.store.delete(self._meta_prefix(namespace) + snapshot_id)
        await self._finish_delete(meta.summary())
        return True

    async def _finish_delete(self, summary: SnapshotSummary) -> None:
        """After the meta is gone: the workspace, then the index entry."""
        await self.store.delete(self.data_key(summary.namespace, summary.snapshot_id))
        index_key = self._index_key(summary)
        if index_key is not None:
            await self.store.delete(index_key)

    async def _reap_if_deleted(self, summary: SnapshotSummary) -> bool:
        """Finish the delete an index entry without a listed meta was left by, if its
        meta is gone indeed; whether it was. A failure is logged (the next listing
        tries again)."""
        meta_key = self._meta_prefix(summary.namespace) + summary.snapshot_id
        try:
            if await self.store.exists(meta_key):
                return False  # written after the listing of metas (or past its page)
            await self._finish_delete(summary)
        except CheckpointError as exc:
            log.warning(
                "e2b snapshot %s: cut-short delete not finished: %s", summary.snapshot_id, exc
            )
            return True  # still deleted (no meta), only not cleaned up yet
        log.info("e2b snapshot %s: a cut-short delete finished", summary.snapshot_id)
        return True
