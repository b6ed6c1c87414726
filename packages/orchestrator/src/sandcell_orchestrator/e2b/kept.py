"""``KeptRows``: paused E2B sandboxes' rows, kept where a registry wipe cannot reach.

A sandbox's row lives in the registry's E2B table (Redis, for a fleet); a paused
sandbox's workspace lives in the snapshot store. A Redis that forgets everything
(restarted without persistence, flushed) would drop every paused sandbox, whose
files the store still holds. So a paused row is also written to the store, under
its tenant's own prefix:

    e2b/<sha256 of the namespace>/<sandbox id>     E2bSandboxRow JSON (state "paused")

and ``E2bSandboxes`` reads it where the registry has no row: a lookup by id reads
the caller's own object only, and a listing one page of the caller's prefix, so no
tenant sees or reaches another's sandbox (DESIGN rule 8).

The order of writes (``SandboxViews.change``, ``E2bSandboxes.kill``) is what keeps
the object and the row in step without a transaction between Redis and the store:

- a row write that lands as paused is preceded by the object of that very row (the
  same revision), so a paused row never exists without its object, and the newest
  revision any worker has seen is at most the object's (the rebuilt row goes on
  past it: ``rebuilt``);
- a row write that lands as running (a resume) is followed by the object's delete,
  also when an earlier attempt of that change wrote one (its compare-and-set lost to
  a resume on another worker): a delete always comes after the write it undoes;
- a kill deletes the object before it removes the row, so once a kill has begun no
  lookup rebuilds the sandbox from the store;
- but a pause on another worker may write its object after that delete (its write
  was under way when the kill began), then find the row gone: the removal marks the
  id killed in the registry in the same write (``e2b_sandbox_killed``), and a change
  that finds the row gone, or a lookup about to rebuild it, checks the mark and
  deletes the object instead (a wipe leaves no mark: its objects are rebuilt). Only
  those rare paths read the mark; a kill and a lookup of a live row cost no more.

The row holds the sandbox's envd tokens and env (secrets): they are written as they
are, at rest beside the checkpoint of the workspace they belong to, in a store only
the workers' credentials reach (as in Redis); the row's ``repr`` and every log line
and error here name the sandbox id only.
"""

from __future__ import annotations

import logging

import msgspec

from ..errors import CheckpointError
from ..registry import E2bSandboxRow, E2bSandboxTable, validate_e2b_sandbox_id
from ..snapshots import SnapshotNotFoundError, SnapshotStore
from ..snapshots.whole import put_whole, read_whole
from ..tenants import tenant_digest

__all__ = ["KEPT_PREFIX", "KeptRows", "kept_key", "kept_prefix", "rebuilt"]

log = logging.getLogger(__name__)

KEPT_PREFIX = "e2b/"
_ROW_MAX_BYTES = 64 << 20
"""A row is mostly its create body's metadata and env (the body is at most 32 MiB)."""


def kept_prefix(namespace: str) -> str:
    """Where ``namespace``'s paused sandboxes' rows live: ``e2b/<sha256>/``."""
    return f"{KEPT_PREFIX}{tenant_digest(namespace)}/"


def kept_key(namespace: str, sandbox_id: str) -> str:
    """The object of ``sandbox_id``'s row, under ``namespace``'s prefix."""
    return kept_prefix(namespace) + validate_e2b_sandbox_id(sandbox_id)


def rebuilt(row: E2bSandboxRow) -> E2bSandboxRow:
    """The registry row to add for a kept ``row``: one revision past it, so a write
    based on any view from before the wipe fails its compare-and-set."""
    return msgspec.structs.replace(row, revision=row.revision + 1)


class KeptRows:
    """Paused sandboxes' rows in ``store`` (the snapshot store of their checkpoints)."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"KeptRows({self.store!r})"

    async def keep(self, row: E2bSandboxRow) -> None:
        """Write ``row`` (a paused one) to its object; ``CheckpointError`` if the store
        fails (the caller's row write must not land then)."""
        await put_whole(
            self.store,
            kept_key(row.namespace, row.sandbox_id),
            row.to_json(),
            max_bytes=_ROW_MAX_BYTES,
        )

    async def drop(self, namespace: str, sandbox_id: str) -> None:
        """Delete the object (a missing one is fine); ``CheckpointError`` if the store fails."""
        await self.store.delete(kept_key(namespace, sandbox_id))

    async def drop_quietly(self, namespace: str, sandbox_id: str) -> None:
        """``drop``, a failure logged: the registry's row outranks a stale object while
        it exists, and a kill deletes the object again."""
        try:
            await self.drop(namespace, sandbox_id)
        except CheckpointError as exc:
            log.warning("e2b sandbox %s: kept row not deleted: %s", sandbox_id, type(exc).__name__)

    async def read(self, namespace: str, sandbox_id: str) -> E2bSandboxRow | None:
        """``namespace``'s kept row of ``sandbox_id``; ``None`` if there is none (or it is
        unreadable, or names another sandbox or tenant)."""
        try:
            raw = await read_whole(
                self.store, kept_key(namespace, sandbox_id), max_bytes=_ROW_MAX_BYTES
            )
        except SnapshotNotFoundError:
            return None
        try:
            row = E2bSandboxRow.from_json(raw)
        except (msgspec.DecodeError, ValueError):
            log.warning("e2b sandbox %s: the kept row is unreadable; skipping it", sandbox_id)
            return None
        if row.sandbox_id != sandbox_id or row.namespace != namespace or row.state != "paused":
            log.warning("e2b sandbox %s: the kept row is not this sandbox's", sandbox_id)
            return None
        return row

    async def rebuild(
        self, registry: E2bSandboxTable, sandbox_id: str, *, owner: str
    ) -> E2bSandboxRow | None:
        """``owner``'s kept row of ``sandbox_id``, added to ``registry`` again (one
        revision past it); the registry's row if another worker added it first; ``None``
        if there is no kept row, or the sandbox turns out killed.

        A kill on another worker may have rebuilt the row too, deleted the kept row
        (a kill's first step) and removed the row, all between this read and this add:
        the add would bring back a killed sandbox (listed as paused, its checkpoints
        gone). So the kept row is read once more after the add; gone while the added
        row is as it was added (a resume or change writes the row, at a later
        revision, before it touches the kept row), it was a kill, and the row goes.

        A pause racing a kill on another worker can also write the kept row after the
        kill deleted it and removed the row (``views.SandboxViews.change``): the kill's
        mark in the registry (``e2b_sandbox_killed``, set with the row's removal) tells
        that kept row from one a wipe left, so it goes too, and the id is a 404."""
        kept = await self.read(owner, sandbox_id)
        if kept is None:
            return None
        row = rebuilt(kept)
        if await registry.add_e2b_sandbox(row):
            # Read after the add, which found no row: a kill that removed the row (or
            # found none) before the add has marked the id already.
            if await registry.e2b_sandbox_killed(sandbox_id):
                if await registry.e2b_sandbox(sandbox_id) == row:
                    await registry.remove_e2b_sandbox(sandbox_id)
                await self.drop_quietly(owner, sandbox_id)
                log.info("e2b sandbox %s: killed; its kept row dropped", sandbox_id)
                return None
            if await self.read(owner, sandbox_id) is not None:
                log.info("e2b sandbox %s: its row rebuilt from the store", sandbox_id)
                return row
            if await registry.e2b_sandbox(sandbox_id) == row:
                await registry.remove_e2b_sandbox(sandbox_id)
                log.info("e2b sandbox %s: killed while its row was rebuilt", sandbox_id)
                return None
        found = await registry.e2b_sandbox(sandbox_id)
        return found if found is not None and found.namespace == owner else None

    async def page(
        self, namespace: str, *, after: str | None, limit: int
    ) -> tuple[list[str], str | None]:
        """The ids of up to ``limit`` of ``namespace``'s kept rows above ``after``, by id
        (one store listing, S3's ``start-after``), and the last of them when there may
        be more (the page was full), else ``None``."""
        prefix = kept_prefix(namespace)
        entries = await self.store.list(
            prefix, start_after=None if after is None else prefix + after, limit=limit
        )
        ids = [entry.key.removeprefix(prefix) for entry in entries]
        bound = ids[-1] if len(entries) >= limit else None
        return [i for i in ids if _is_id(i)], bound


def _is_id(sandbox_id: str) -> bool:
    try:
        validate_e2b_sandbox_id(sandbox_id)
    except ValueError:
        return False
    return True
