"""E2B's snapshot routes: save a sandbox, fork it, list and delete the snapshots.

POST   /e2b/sandboxes/{id}/snapshots     SnapshotSandbox -> 201 SnapshotInfo
POST   /e2b/sandboxes/{id}/fork          ForkSandbox -> 201 [ForkResult]
GET    /e2b/snapshots                    [SnapshotInfo] (?sandboxID=&name=&limit=&nextToken=)
DELETE /e2b/templates/{snapshot id}      204 (a snapshot's: the only templates served so)
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from .control_context import ControlContext, guarded, json_response, page_limit
from .errors import E2bError, read_message
from .saved import SnapshotMeta, snapshot_ref
from .wire import ForkError, ForkResult, ForkSandbox, SnapshotInfo, SnapshotSandbox

__all__ = ["SnapshotRoutes"]


def _snapshot_info(meta: SnapshotMeta) -> SnapshotInfo:
    return SnapshotInfo(snapshotID=meta.ref, names=[meta.ref])


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
            Route(
                prefix + "/templates/{template_id}",
                guarded(self.delete_snapshot),
                methods=["DELETE"],
            ),
        ]

    async def snapshot(self, request: Request) -> Response:
        """E2B's ``create_snapshot``: the sandbox's workspace, saved; it keeps running."""
        sandbox = await self._context.one(request)
        message = await read_message(request, SnapshotSandbox, empty_ok=True)
        if message.name is not None:
            raise E2bError(400, "bad_request", "name: not supported by sandcell")
        meta = await self._context.sandboxes().snapshot(sandbox)
        return json_response(_snapshot_info(meta), 201)

    async def list_snapshots(self, request: Request) -> Response:
        """E2B's ``list_snapshots``: the caller's snapshots by id, paged (``nextToken``:
        the last id of the page before), filtered by source ``sandboxID`` and ``name``
        (a snapshot's id, as sandcell names them by id only)."""
        owner = self._context.owner(request)
        limit = page_limit(request)
        token = request.query_params.get("nextToken") or None
        after = None if token is None else snapshot_ref(token)
        if token is not None and after is None:
            raise E2bError(400, "bad_request", "nextToken: not a token this service gave")
        source = request.query_params.get("sandboxID") or None
        name = request.query_params.get("name") or None
        wanted = None if name is None else (snapshot_ref(name) or "")
        snapshots = self._context.sandboxes().snapshots
        picked: list[SnapshotMeta] = []
        more = False
        # The ids are at most the per-tenant cap (one store listing): reading each
        # one's meta for the filters stays bounded by it.
        for snapshot_id in await snapshots.ids(owner):
            if (after is not None and snapshot_id <= after) or (
                wanted is not None and snapshot_id != wanted
            ):
                continue
            meta = await snapshots.get(owner, snapshot_id)
            if meta is None or (source is not None and meta.sandbox_id != source):
                continue
            if len(picked) == limit:
                more = True
                break
            picked.append(meta)
        headers = {"X-Next-Token": picked[-1].snapshot_id} if more else None
        return json_response([_snapshot_info(m) for m in picked], headers=headers)

    async def delete_snapshot(self, request: Request) -> Response:
        """E2B's ``delete_snapshot`` (its template delete): 404 for an unknown id and for
        another tenant's alike."""
        owner = self._context.owner(request)
        raw = str(request.path_params["template_id"])
        bare = snapshot_ref(raw)
        if bare is None or not await self._context.sandboxes().snapshots.delete(owner, bare):
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
