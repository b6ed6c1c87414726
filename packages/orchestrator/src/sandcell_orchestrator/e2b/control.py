"""E2B's control plane under ``/e2b``: the sandbox lifecycle, as the ``e2b`` SDK calls it.

    POST   /e2b/v2/sandboxes                 NewSandbox -> 201 SandboxCreated
    GET    /e2b/v2/sandboxes                 [ListedSandbox] (?metadata=&state=&template=
                                             &startedAfter=&order=&limit=&nextToken=)
    GET    /e2b/sandboxes                    [ListedSandbox] (running ones, the v1 list;
                                             ?metadata=)
    GET    /e2b/sandboxes/{id}               SandboxDetail
    DELETE /e2b/sandboxes/{id}               204
    POST   /e2b/sandboxes/{id}/timeout       SetTimeout -> 204
    PUT    /e2b/sandboxes/{id}/network       UpdateNetwork -> 204 (the egress policy, replaced)
    GET    /e2b/sandboxes/{id}/metrics       [SandboxMetric] (?start=&end=, unix seconds)
    POST   /e2b/sandboxes/{id}/pause         PauseSandbox -> 204 (409 if already paused)
    POST   /e2b/v2/sandboxes/{id}/connect    ConnectSandbox -> 200 (running) / 201 (resumed)
    POST   /e2b/sandboxes/{id}/resume        ConnectSandbox -> 201 (the older resume call)
    POST   /e2b/sandboxes/{id}/snapshots     SnapshotSandbox -> 201 SnapshotInfo
    POST   /e2b/sandboxes/{id}/fork          ForkSandbox -> 201 [ForkResult]
    GET    /e2b/snapshots                    [SnapshotInfo] (?sandboxID=&name=&limit=&nextToken=)
    DELETE /e2b/templates/{snapshot id}      204 (a snapshot's, by id or name: the only
                                             templates served so)

The API key comes in ``X-API-KEY`` (or as a bearer key) and names the tenant;
every lookup is scoped by it. Paging: ``limit`` (1..100, default 100) and an
opaque ``nextToken``; the next page's token comes back in ``X-Next-Token``. Both
listings go by start time, newest first as E2B's do (the v2 one oldest first with
``order=asc``); each v2 page reads at most ``limit + 1`` rows of the registry past
``nextToken``, more only when the filters leave rows out, and then a bounded number
(``listing.SandboxListing.page``).
"""

from __future__ import annotations

import datetime
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import ProtocolError, encode
from sandcell_protocol.env_vars import validate_env
from sandcell_protocol.sandbox_messages import MetricsQuery

from .egress import egress_policy, public_traffic
from .errors import E2bError, e2b_error_response, read_message
from .listing import ListingOrder, page_key, page_token
from .sandboxes import E2bSandbox, E2bSandboxes
from .saved import (
    SNAPSHOT_TAG,
    SnapshotMeta,
    SnapshotName,
    parse_snapshot_name,
    snapshot_ref,
    team_slug,
)
from .wire import (
    ConnectSandbox,
    ForkError,
    ForkResult,
    ForkSandbox,
    ListedSandbox,
    NewSandbox,
    PauseSandbox,
    SandboxCreated,
    SandboxDetail,
    SandboxMetric,
    SetTimeout,
    SnapshotInfo,
    SnapshotSandbox,
    UpdateNetwork,
)

__all__ = ["ENVD_VERSION", "ControlPlane"]

ENVD_VERSION = "0.6.4"
"""The envd version announced: the SDK enables every feature served here from it."""

_JSON = "application/json"
_MAX_LIMIT = 100
_MAX_UNIX_S = 10_413_791_999
"""2299-12-31T23:59:59Z: the latest time E2B's metrics take (its store's last date)."""
Endpoint = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")


def _iso(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC).isoformat()


def _metadata_query(request: Request) -> dict[str, str]:
    """The ``metadata`` query (``key=value&...``, each part escaped once more, as the
    SDK sends it): what a listed sandbox's metadata must all hold."""
    metadata = request.query_params.get("metadata")
    return {
        urllib.parse.unquote(k): urllib.parse.unquote(v)
        for k, v in urllib.parse.parse_qsl(metadata or "", keep_blank_values=True)
    }


def _instant(raw: str | None) -> float | None:
    """``startedAfter`` (RFC 3339, as the SDK sends it; no offset: UTC) in epoch seconds."""
    if not raw:
        return None
    try:
        moment = datetime.datetime.fromisoformat(raw) if len(raw) <= 64 else None
    except ValueError:
        moment = None
    if moment is None:
        raise E2bError(400, "bad_request", "startedAfter: an RFC 3339 time")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _unix_seconds(request: Request, name: str) -> int | None:
    """``start`` or ``end`` of a metrics query: whole unix seconds, as the SDK sends them."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    # ASCII digits, few of them: ``int`` takes '²', '-1', ' 7' and 4300-digit strings.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 11) or int(raw) > _MAX_UNIX_S:
        raise E2bError(400, "bad_request", f"{name}: unix seconds, 0..{_MAX_UNIX_S}")
    return int(raw)


def _json(value: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode(value), status_code=status, media_type=_JSON, headers=headers)


class ControlPlane:
    """The control-plane routes over one ``E2bSandboxes`` table."""

    def __init__(
        self,
        sandboxes: Callable[[], E2bSandboxes],
        *,
        namespace_of_key: Callable[[str | None], str],
        domain: str | None,
    ) -> None:
        self._sandboxes = sandboxes
        self._namespace_of_key = namespace_of_key
        self._domain = domain

    def routes(self, prefix: str = "/e2b") -> list[BaseRoute]:
        g = self._guarded
        one = prefix + "/sandboxes/{sandbox_id}"
        return [
            Route(prefix + "/v2/sandboxes", g(self.create), methods=["POST"]),
            Route(prefix + "/v2/sandboxes", g(self.list_v2), methods=["GET"]),
            Route(prefix + "/sandboxes", g(self.list_v1), methods=["GET"]),
            Route(one, g(self.detail), methods=["GET"]),
            Route(one, g(self.kill), methods=["DELETE"]),
            Route(one + "/timeout", g(self.set_timeout), methods=["POST"]),
            Route(one + "/network", g(self.update_network), methods=["PUT"]),
            Route(one + "/metrics", g(self.metrics), methods=["GET"]),
            Route(one + "/pause", g(self.pause), methods=["POST"]),
            Route(one + "/resume", g(self.resume), methods=["POST"]),
            Route(prefix + "/v2/sandboxes/{sandbox_id}/connect", g(self.connect), methods=["POST"]),
            Route(one + "/snapshots", g(self.snapshot), methods=["POST"]),
            Route(one + "/fork", g(self.fork), methods=["POST"]),
            Route(prefix + "/snapshots", g(self.list_snapshots), methods=["GET"]),
            # ``:path``: the SDK sends a name's ``/`` as ``%2F``, which arrives decoded.
            Route(
                prefix + "/templates/{template_id:path}",
                g(self.delete_snapshot),
                methods=["DELETE"],
            ),
        ]

    @staticmethod
    def _guarded(endpoint: Endpoint) -> Endpoint:
        async def guarded(request: Request) -> Response:
            try:
                return await endpoint(request)
            except Exception as exc:
                return e2b_error_response(exc)

        return guarded

    def _owner(self, request: Request) -> str:
        key = request.headers.get("x-api-key")
        if key is None:
            scheme, _, credential = request.headers.get("authorization", "").partition(" ")
            key = credential if scheme.lower() == "bearer" else None
        return self._namespace_of_key(key)

    async def _one(self, request: Request) -> E2bSandbox:
        owner = self._owner(request)
        return await self._sandboxes().get(str(request.path_params["sandbox_id"]), owner=owner)

    def _created(self, sandbox: E2bSandbox) -> SandboxCreated:
        return SandboxCreated(
            templateID=sandbox.template,
            sandboxID=sandbox.sandbox_id,
            clientID="sandcell",
            envdVersion=ENVD_VERSION,
            envdAccessToken=sandbox.access_token,
            trafficAccessToken=sandbox.traffic_token,
            domain=self._domain,
        )

    @staticmethod
    def _snapshot_info(meta: SnapshotMeta) -> SnapshotInfo:
        slug = team_slug(meta.namespace)
        return SnapshotInfo(snapshotID=meta.ref(slug), names=meta.names(slug))

    def _listed(self, sandbox: E2bSandbox) -> ListedSandbox:
        return ListedSandbox(
            templateID=sandbox.template,
            sandboxID=sandbox.sandbox_id,
            clientID="sandcell",
            startedAt=_iso(sandbox.started_at_s),
            endAt=_iso(sandbox.end_at_s),
            # The runner's limits as read at create (``E2bSandboxes._with_limits``); a
            # row that has none (an older orchestrator's, a runner that could not say)
            # answers 1 CPU and 0 MB, as before.
            cpuCount=sandbox.row.cpu_count or 1,
            memoryMB=sandbox.row.memory_mib,
            diskSizeMB=sandbox.row.disk_mib,
            state="paused" if sandbox.state == "paused" else "running",
            envdVersion=ENVD_VERSION,
            metadata=sandbox.metadata,
        )

    # -- routes ---------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        owner = self._owner(request)
        new = await read_message(request, NewSandbox)
        unsupported = {
            "mcp": new.mcp,
            "iam": new.iam,
            "volumeMounts": new.volumeMounts,
            "autoResume": new.autoResume is not None and new.autoResume.enabled,
        }
        for name, value in unsupported.items():
            if value:
                raise E2bError(400, "bad_request", f"{name}: not supported by sandcell")
        try:
            # Kept for every later command: a bad name is this call's 400, not theirs.
            env = validate_env(new.envVars, field="envVars")
        except ProtocolError as exc:
            raise E2bError(400, "bad_request", str(exc)) from None
        sandbox = await self._sandboxes().create(
            owner=owner,
            template=new.templateID,
            timeout_s=new.timeout,
            metadata=new.metadata,
            env=env,
            auto_pause=bool(new.autoPause),
            idempotency_key=request.headers.get("idempotency-key"),
            egress=egress_policy(new.allow_internet_access, new.network),
            public_traffic=public_traffic(new.network),
        )
        return _json(self._created(sandbox), 201)

    async def list_v2(self, request: Request) -> Response:
        owner = self._owner(request)
        raw_limit = request.query_params.get("limit") or str(_MAX_LIMIT)
        # ASCII digits, few of them: ``isdigit`` alone takes '²' (which ``int`` refuses)
        # and other scripts' digits, and ``int`` refuses a string of over 4300 digits.
        digits = raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 3
        if not digits or not 1 <= int(raw_limit) <= _MAX_LIMIT:
            raise E2bError(400, "bad_request", f"limit: must be 1..{_MAX_LIMIT}")
        order: ListingOrder
        match request.query_params.get("order") or "desc":
            case "asc":
                order = "asc"
            case "desc":
                order = "desc"
            case _:
                raise E2bError(400, "bad_request", "order: asc, desc")
        token = request.query_params.get("nextToken") or None
        try:
            after = None if token is None else page_key(token, order)
        except ValueError:
            raise E2bError(400, "bad_request", "nextToken: not a token this service gave") from None
        states = request.query_params.get("state")
        wanted = set(states.split(",")) if states else {"running", "paused"}
        if not wanted <= {"running", "paused"}:
            raise E2bError(400, "bad_request", "state: running, paused")
        wanted_meta = _metadata_query(request)
        # The SDK's ``SandboxQuery(template=, started_after=)``: a filter ignored would
        # answer sandboxes the caller asked to leave out (and, say, kill them).
        template = request.query_params.get("template") or None
        started_after = _instant(request.query_params.get("startedAfter"))

        def picks(sandbox: E2bSandbox) -> bool:
            return (template is None or sandbox.template == template) and all(
                sandbox.metadata.get(k) == v for k, v in wanted_meta.items()
            )

        page, next_after = await self._sandboxes().listing.page(
            owner,
            after=after,
            limit=int(raw_limit),
            order=order,
            states=sorted(wanted),
            started_after=started_after,
            picks=picks,
        )
        headers = None if next_after is None else {"X-Next-Token": page_token(next_after, order)}
        return _json([self._listed(s) for s in page], headers=headers)

    async def list_v1(self, request: Request) -> Response:
        """E2B's first listing: the running sandboxes, newest first, unpaged, with the
        same ``metadata`` query as the second."""
        owner = self._owner(request)
        wanted_meta = _metadata_query(request)
        items = [
            s
            for s in reversed(await self._sandboxes().running_of(owner))
            if all(s.metadata.get(k) == v for k, v in wanted_meta.items())
        ]
        return _json([self._listed(s) for s in items])

    async def detail(self, request: Request) -> Response:
        sandbox = await self._one(request)
        listed = self._listed(sandbox)
        detail = SandboxDetail(
            **msgspec.structs.asdict(listed),
            envdAccessToken=sandbox.access_token,
            domain=self._domain,
        )
        return _json(detail)

    async def kill(self, request: Request) -> Response:
        await self._sandboxes().kill(await self._one(request))
        return Response(status_code=204)

    async def set_timeout(self, request: Request) -> Response:
        sandbox = await self._one(request)
        message = await read_message(request, SetTimeout)
        await self._sandboxes().set_timeout(sandbox, message.timeout)
        return Response(status_code=204)

    async def update_network(self, request: Request) -> Response:
        sandbox = await self._one(request)
        message = await read_message(request, UpdateNetwork, empty_ok=True)
        policy = egress_policy(message.allow_internet_access, message.network())
        await self._sandboxes().set_network(sandbox, policy)
        return Response(status_code=204)

    async def metrics(self, request: Request) -> Response:
        """E2B's ``get_metrics``: the samples the sandbox's runner took in ``[start, end]``
        (every 5 s; both optional: since the sandbox started, until now)."""
        sandbox = await self._one(request)
        start, end = _unix_seconds(request, "start"), _unix_seconds(request, "end")
        if start is not None and end is not None and start > end:
            raise E2bError(400, "bad_request", "start time cannot be after end time")
        samples = await self._sandboxes().metrics(sandbox, MetricsQuery(start_s=start, end_s=end))
        return _json(
            [
                SandboxMetric(
                    timestamp=_iso(s.at_s),
                    timestampUnix=int(s.at_s),
                    cpuCount=s.cpu_count,
                    cpuUsedPct=s.cpu_used_pct,
                    memUsed=s.mem_used_bytes,
                    memTotal=s.mem_total_bytes,
                    memCache=s.mem_cache_bytes,
                    diskUsed=s.disk_used_bytes,
                    diskTotal=s.disk_total_bytes,
                )
                for s in samples
            ]
        )

    async def pause(self, request: Request) -> Response:
        sandbox = await self._one(request)
        await read_message(request, PauseSandbox, empty_ok=True)
        if not await self._sandboxes().pause(sandbox):
            raise E2bError(409, "session_conflict", f"sandbox {sandbox.sandbox_id} is paused")
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        sandbox = await self._one(request)
        message = await read_message(request, ConnectSandbox, empty_ok=True)
        was_paused = sandbox.state == "paused"
        await self._sandboxes().connect(sandbox, timeout_s=message.timeout)
        return _json(self._created(sandbox), 201 if was_paused else 200)

    async def resume(self, request: Request) -> Response:
        sandbox = await self._one(request)
        message = await read_message(request, ConnectSandbox, empty_ok=True)
        if sandbox.state != "paused":
            raise E2bError(409, "session_conflict", f"sandbox {sandbox.sandbox_id} is running")
        await self._sandboxes().connect(sandbox, timeout_s=message.timeout)
        return _json(self._created(sandbox), 201)

    async def snapshot(self, request: Request) -> Response:
        """E2B's ``create_snapshot``: the sandbox's workspace, saved; it keeps running.
        ``name`` is checked first, as E2B does, then the sandbox looked up."""
        message = await read_message(request, SnapshotSandbox, empty_ok=True)
        name, tag = None, SNAPSHOT_TAG
        if message.name is not None:
            parsed = _snapshot_name(message.name, self._owner(request), "Invalid name")
            name, tag = parsed.alias, parsed.tag or SNAPSHOT_TAG
        sandbox = await self._one(request)
        meta = await self._sandboxes().snapshot(sandbox, name=name, tag=tag)
        return _json(self._snapshot_info(meta), 201)

    async def list_snapshots(self, request: Request) -> Response:
        """E2B's ``list_snapshots``: the caller's snapshots, one entry per unnamed
        snapshot and per name (its newest, or newest of the ``name``'s tag), newest
        first by when the first was taken, paged (``nextToken``: the last entry of the
        page before); ``sandboxID``: the sandbox the first was taken of."""
        owner = self._owner(request)
        raw_limit = request.query_params.get("limit") or str(_MAX_LIMIT)
        digits = raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 3
        if not digits or not 1 <= int(raw_limit) <= _MAX_LIMIT:
            raise E2bError(400, "bad_request", f"limit: must be 1..{_MAX_LIMIT}")
        limit = int(raw_limit)
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
        # At most the per-tenant cap of metas (one store listing, one read each): the
        # names, the filters and the order all need them.
        groups: dict[str, list[SnapshotMeta]] = {}
        for meta in await self._sandboxes().snapshots.metas(owner):
            key = "i" + meta.snapshot_id if meta.name is None else "n" + meta.name
            groups.setdefault(key, []).append(meta)
        entries: list[tuple[tuple[int, str], SnapshotMeta]] = []
        for key, metas in groups.items():
            metas.sort(key=lambda m: (m.created_at_s, m.snapshot_id))
            first = metas[0]
            shown = [m for m in metas if tag is None or m.tag == tag]
            if (keys is not None and key not in keys) or not shown:
                continue
            if source is not None and first.sandbox_id != source:
                continue
            page_at = (round(first.created_at_s * 1_000_000), key)
            if after is None or page_at < after:
                entries.append((page_at, shown[-1]))
        entries.sort(key=lambda entry: entry[0], reverse=True)
        headers = None
        if len(entries) > limit:
            last = entries[limit - 1][0]
            headers = {"X-Next-Token": f"{last[0]}_{last[1]}"}
        return _json([self._snapshot_info(m) for _, m in entries[:limit]], headers=headers)

    async def delete_snapshot(self, request: Request) -> Response:
        """E2B's ``delete_snapshot`` (its template delete), by id or by name (every tag
        of it, as E2B deletes the whole template): 404 for an unknown one and for
        another tenant's alike; a templateID that is no E2B name is E2B's 400."""
        owner = self._owner(request)
        raw = str(request.path_params["template_id"])
        snapshots = self._sandboxes().snapshots
        bare = snapshot_ref(raw)
        if bare is not None and await snapshots.delete(owner, bare):
            return Response(status_code=204)
        try:
            name = parse_snapshot_name(raw)
        except ValueError as exc:
            raise E2bError(400, "bad_request", f"Invalid template ID: {exc}") from None
        found: list[SnapshotMeta] = []
        if name.namespace is None or name.namespace == team_slug(owner):
            found = await snapshots.named(owner, name.alias)
        deleted = [await snapshots.delete(owner, m.snapshot_id) for m in found]
        if not any(deleted):
            raise E2bError(404, "not_found", f"template {raw[:80]!r} not found")
        return Response(status_code=204)

    async def fork(self, request: Request) -> Response:
        """E2B's ``fork``: a snapshot, then ``count`` sandboxes from it (default 1, with
        E2B's default timeout of 15 s); each result is a sandbox or that fork's error."""
        sandbox = await self._one(request)
        message = await read_message(request, ForkSandbox, empty_ok=True)
        results = await self._sandboxes().fork(
            sandbox,
            timeout_s=15 if message.timeout is None else message.timeout,
            count=1 if message.count is None else message.count,
        )
        return _json(
            [
                ForkResult(error=ForkError(code=r.status, message=str(r)))
                if isinstance(r, E2bError)
                else ForkResult(sandbox=self._created(r))
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
