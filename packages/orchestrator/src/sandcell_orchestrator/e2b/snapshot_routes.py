"""E2B's snapshot routes: save a sandbox, fork it, list and delete the snapshots.

POST   /e2b/sandboxes/{id}/snapshots     SnapshotSandbox -> 201 SnapshotInfo
POST   /e2b/sandboxes/{id}/fork          ForkSandbox -> 201 [ForkResult]
GET    /e2b/snapshots                    [SnapshotInfo] (?sandboxID=&name=&limit=&nextToken=)
DELETE /e2b/templates/{snapshot id}      204 (a snapshot's, by id or name: the only
                                         templates served so)
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from .control_context import ControlContext, guarded, json_response, page_limit
from .errors import E2bError, read_message
from .saved import (
    NAME_MAX_CHARS,
    SNAPSHOT_TAG,
    SnapshotMeta,
    SnapshotName,
    SnapshotSummary,
    parse_snapshot_name,
    snapshot_ref,
    team_slug,
)
from .wire import ForkError, ForkResult, ForkSandbox, SnapshotInfo, SnapshotSandbox

__all__ = ["SnapshotRoutes"]


def _snapshot_info(meta: SnapshotMeta | SnapshotSummary) -> SnapshotInfo:
    # A meta answers as its summary: one place spells the wire id and names.
    summary = meta.summary() if isinstance(meta, SnapshotMeta) else meta
    slug = team_slug(summary.namespace)
    return SnapshotInfo(snapshotID=summary.ref(slug), names=summary.names(slug))


class SnapshotRoutes:
    """The routes over the tenant's snapshots and the sandboxes made from them."""

    def __init__(self, context: ControlContext) -> None:
        self._context = context

    def routes(self, prefix: str) -> list[BaseRoute]:
        """The snapshot routes under ``prefix``."""
        one = prefix + "/sandboxes/{sandbox_id}"
        return [
            Route(one + "/snapshots", guarded(self.snapshot), methods=["POST"]),
            Route(one + "/fork", guarded(self.fork), methods=["POST"]),
            Route(prefix + "/snapshots", guarded(self.list_snapshots), methods=["GET"]),
            # The SDK sends a namespaced name's ``/`` as ``%2F``, which arrives decoded:
            # ``<slug>/<name>`` is a second route, not ``:path`` (which matches
            # ``/templates/`` too, so Starlette redirected ``/templates`` there).
            Route(
                prefix + "/templates/{template_id}",
                guarded(self.delete_snapshot),
                methods=["DELETE"],
            ),
            Route(
                prefix + "/templates/{slug}/{template_id}",
                guarded(self.delete_snapshot),
                methods=["DELETE"],
            ),
        ]

    async def snapshot(self, request: Request) -> Response:
        """E2B's ``create_snapshot``: the sandbox's workspace, saved; it keeps running.
        ``name`` is checked first, as E2B does, then the sandbox looked up."""
        message = await read_message(request, SnapshotSandbox, empty_ok=True)
        name, tag = None, SNAPSHOT_TAG
        if message.name is not None:
            parsed = _snapshot_name(message.name, self._context.owner(request), "Invalid name")
            _check_new_name(parsed)
            name, tag = parsed.alias, parsed.tag or SNAPSHOT_TAG
        sandbox = await self._context.one(request)
        meta = await self._context.sandboxes().snapshot(sandbox, name=name, tag=tag)
        return json_response(_snapshot_info(meta), 201)

    async def list_snapshots(self, request: Request) -> Response:
        """E2B's ``list_snapshots``: the caller's snapshots, one entry per unnamed
        snapshot and per name (its newest, or newest of the ``name``'s tag), newest
        first by when the first was taken, paged (``nextToken``: the last entry of the
        page before); ``sandboxID``: the sandbox the first was taken of."""
        owner = self._context.owner(request)
        limit = page_limit(request)
        token = request.query_params.get("nextToken") or None
        after = None if token is None else _snapshot_page_key(token)
        if token is not None and after is None:
            raise E2bError(400, "bad_request", "Invalid next token")
        source = request.query_params.get("sandboxID") or None
        raw_name = request.query_params.get("name") or None
        keys: set[str] | None = None
        tag: str | None = None
        if raw_name is not None:
            wanted = _snapshot_name(raw_name, owner, "Invalid name")
            keys = {"n" + wanted.alias}
            bare = snapshot_ref(raw_name.strip())
            if bare is not None:
                keys.add("i" + bare)
            tag = wanted.tag or (SNAPSHOT_TAG if wanted.tagged else None)
        # At most the per-tenant cap of snapshots, from two store listings (their
        # index entries' keys hold the names and times: ``saved``): the names, the
        # filters and the order all need them.
        groups: dict[str, list[SnapshotSummary]] = {}
        for meta in await self._context.sandboxes().snapshots.summaries(owner):
            key = "i" + meta.snapshot_id if meta.name is None else "n" + meta.name
            groups.setdefault(key, []).append(meta)
        entries: list[tuple[tuple[int, str], SnapshotSummary]] = []
        for key, metas in groups.items():
            metas.sort(key=lambda m: (m.created_at_us, m.snapshot_id))
            first = metas[0]
            shown = [m for m in metas if tag is None or m.tag == tag]
            if (keys is not None and key not in keys) or not shown:
                continue
            if source is not None and first.sandbox_id != source:
                continue
            page_at = (first.created_at_us, key)
            if after is None or page_at < after:
                entries.append((page_at, shown[-1]))
        entries.sort(key=lambda entry: entry[0], reverse=True)
        headers = None
        if len(entries) > limit:
            last = entries[limit - 1][0]
            headers = {"X-Next-Token": f"{last[0]}_{last[1]}"}
        return json_response([_snapshot_info(m) for _, m in entries[:limit]], headers=headers)

    async def delete_snapshot(self, request: Request) -> Response:
        """E2B's ``delete_snapshot`` (its template delete), by id or by name (every tag
        of it, as E2B deletes the whole template): 404 for an unknown one and for
        another tenant's alike; a templateID that is no E2B name is E2B's 400."""
        owner = self._context.owner(request)
        raw = str(request.path_params["template_id"])
        if "slug" in request.path_params:
            raw = f"{request.path_params['slug']}/{raw}"
        snapshots = self._context.sandboxes().snapshots
        bare = snapshot_ref(raw)
        if bare is not None and await snapshots.delete(owner, bare):
            return Response(status_code=204)
        try:
            name = parse_snapshot_name(raw)
        except ValueError as exc:
            raise E2bError(400, "bad_request", f"Invalid template ID: {exc}") from None
        found: list[SnapshotSummary] = []
        if name.namespace is None or name.namespace == team_slug(owner):
            found = await snapshots.named(owner, name.alias)
        deleted = [await snapshots.delete(owner, m.snapshot_id) for m in found]
        if not any(deleted):
            raise E2bError(404, "not_found", f"template {raw[:80]!r} not found")
        return Response(status_code=204)

    async def fork(self, request: Request) -> Response:
        """E2B's ``fork``: a snapshot, then ``count`` sandboxes from it (default 1, with
        E2B's default timeout of 15 s); each result is a sandbox or that fork's error."""
        sandbox = await self._context.one(request)
        message = await read_message(request, ForkSandbox, empty_ok=True)
        results = await self._context.sandboxes().fork(
            sandbox,
            timeout_s=15 if message.timeout is None else message.timeout,
            count=1 if message.count is None else message.count,
        )
        return json_response(
            [
                ForkResult(error=ForkError(code=r.status, message=str(r)))
                if isinstance(r, E2bError)
                else ForkResult(sandbox=self._context.created(r))
                for r in results
            ],
            201,
        )


def _snapshot_name(raw: str, owner: str, what: str) -> SnapshotName:
    """A request's snapshot name, E2B's 400s for an invalid one and for another
    namespace than the caller's (it says only the caller's own slug)."""
    try:
        name = parse_snapshot_name(raw)
    except ValueError as exc:
        raise E2bError(400, "bad_request", f"{what}: {exc}") from None
    slug = team_slug(owner)
    if name.namespace is not None and name.namespace != slug:
        raise E2bError(
            400,
            "bad_request",
            f"namespace '{name.namespace[:80]}' must match your team '{slug}'",
        )
    return name


def _check_new_name(name: SnapshotName) -> None:
    """E2B's 400 for a new snapshot's name or tag past ``NAME_MAX_CHARS``, before any
    copy: a longer one made a meta past its cap, a 500 after the whole workspace copy.
    Only new names are held to it: a longer one stored before still lists and deletes."""
    for what, value in (("name", name.alias), ("tag", name.tag or "")):
        if len(value) > NAME_MAX_CHARS:
            raise E2bError(
                400,
                "bad_request",
                f"Invalid name: the {what} is {len(value)} characters, at most"
                f" {NAME_MAX_CHARS} are allowed",
            )


def _snapshot_page_key(token: str) -> tuple[int, str] | None:
    """A snapshot listing's ``nextToken`` (``<µs>_<entry key>``); None if not one."""
    micros, sep, key = token.partition("_")
    valid = (
        bool(sep)
        and micros.isascii()
        and micros.isdigit()
        and len(micros) <= 20
        and key[:1] in ("i", "n")
        and 1 < len(key) <= 200
    )
    return (int(micros), key) if valid else None
