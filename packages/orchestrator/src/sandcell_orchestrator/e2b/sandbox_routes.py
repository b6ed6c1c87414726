"""E2B's sandbox routes: create, list, detail, kill, timeout, network, pause, connect.

    POST   /e2b/v2/sandboxes                 NewSandbox -> 201 SandboxCreated
    GET    /e2b/v2/sandboxes                 [ListedSandbox] (?metadata=&state=&template=
                                             &startedAfter=&order=&limit=&nextToken=)
    GET    /e2b/sandboxes                    [ListedSandbox] (running ones, the v1 list;
                                             ?metadata=)
    GET    /e2b/sandboxes/{id}               SandboxDetail
    DELETE /e2b/sandboxes/{id}               204
    POST   /e2b/sandboxes/{id}/timeout       SetTimeout -> 204
    PUT    /e2b/sandboxes/{id}/network       UpdateNetwork -> 204 (the egress policy, replaced)
    POST   /e2b/sandboxes/{id}/pause         PauseSandbox -> 204 (409 if already paused)
    POST   /e2b/v2/sandboxes/{id}/connect    ConnectSandbox -> 200 (running) / 201 (resumed)
    POST   /e2b/sandboxes/{id}/resume        ConnectSandbox -> 201 (the older resume call)

Paging: ``limit`` (1..100, default 100) and an opaque ``nextToken``; the next page's
token comes back in ``X-Next-Token``. Both listings go by start time, newest first as
E2B's do (the v2 one oldest first with ``order=asc``); each v2 page reads at most
``limit + 1`` rows of the registry past ``nextToken``, more only when the filters
leave rows out, and then a bounded number (``listing.SandboxListing.page``).
"""

from __future__ import annotations

import datetime
import urllib.parse

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import ProtocolError
from sandcell_protocol.env_vars import validate_env

from .control_context import (
    ENVD_VERSION,
    ControlContext,
    guarded,
    iso,
    json_response,
    page_limit,
)
from .egress import egress_policy, public_traffic
from .errors import E2bError, read_message
from .listing import ListingOrder, page_key, page_token
from .sandboxes import E2bSandbox
from .saved import SnapshotName, parse_snapshot_name, team_slug
from .wire import (
    ConnectSandbox,
    ListedSandbox,
    NewSandbox,
    PauseSandbox,
    SandboxDetail,
    SetTimeout,
    UpdateNetwork,
)

__all__ = ["SandboxRoutes"]


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


def _template_query(raw: str | None) -> SnapshotName | None:
    """The ``template`` filter, parsed as E2B parses it: a template id or name, with no
    tag (a sandbox is of a template, not of one of its tags); 400 otherwise, with
    E2B's texts."""
    if raw is None:
        return None
    if ":" in raw:
        reason = "tags are not supported here because sandboxes are not tag-scoped"
        raise E2bError(400, "bad_request", f"Invalid template: {reason}")
    try:
        return parse_snapshot_name(raw)
    except ValueError as exc:
        raise E2bError(400, "bad_request", f"Invalid template: {exc}") from None


def _made_from(sandbox: E2bSandbox, template: SnapshotName, slug: str) -> bool:
    """Whether ``sandbox`` is of ``template``: by its ``templateID`` or its ``alias``
    (a snapshot's name also as ``<slug>/<name>``), as E2B resolves the filter to a
    template id."""
    if template.namespace is None:
        return template.alias in (sandbox.template_id, sandbox.alias)
    named = sandbox.row.template_id is not None and sandbox.alias is not None
    return named and template.namespace == slug and template.alias == sandbox.alias


class SandboxRoutes:
    """The routes over one sandbox's lifecycle and the tenant's listings of them."""

    def __init__(self, context: ControlContext) -> None:
        self._context = context

    def routes(self, prefix: str) -> list[BaseRoute]:
        """The sandbox routes under ``prefix``."""
        one = prefix + "/sandboxes/{sandbox_id}"
        return [
            Route(prefix + "/v2/sandboxes", guarded(self.create), methods=["POST"]),
            Route(prefix + "/v2/sandboxes", guarded(self.list_v2), methods=["GET"]),
            Route(prefix + "/sandboxes", guarded(self.list_v1), methods=["GET"]),
            Route(one, guarded(self.detail), methods=["GET"]),
            Route(one, guarded(self.kill), methods=["DELETE"]),
            Route(one + "/timeout", guarded(self.set_timeout), methods=["POST"]),
            Route(one + "/network", guarded(self.update_network), methods=["PUT"]),
            Route(one + "/pause", guarded(self.pause), methods=["POST"]),
            Route(one + "/resume", guarded(self.resume), methods=["POST"]),
            Route(
                prefix + "/v2/sandboxes/{sandbox_id}/connect",
                guarded(self.connect),
                methods=["POST"],
            ),
        ]

    @staticmethod
    def _listed(sandbox: E2bSandbox) -> ListedSandbox:
        return ListedSandbox(
            templateID=sandbox.template_id,
            alias=sandbox.alias,
            sandboxID=sandbox.sandbox_id,
            clientID="sandcell",
            startedAt=iso(sandbox.started_at_s),
            endAt=iso(sandbox.end_at_s),
            # The runner's limits as read at create (``SandboxCreation._with_limits``):
            # a row that has none (an older orchestrator's, a runner that could not
            # say) answers 1 CPU and 0 MB, as before.
            cpuCount=sandbox.row.cpu_count or 1,
            memoryMB=sandbox.row.memory_mib,
            diskSizeMB=sandbox.row.disk_mib,
            state="paused" if sandbox.state == "paused" else "running",
            envdVersion=ENVD_VERSION,
            metadata=sandbox.metadata,
        )

    async def create(self, request: Request) -> Response:
        """E2B's ``Sandbox.create``: a new sandbox of the caller's (or one from a snapshot)."""
        owner = self._context.owner(request)
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
        sandbox = await self._context.sandboxes().create(
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
        return json_response(self._context.created(sandbox), 201)

    async def list_v2(self, request: Request) -> Response:
        """E2B's second listing: the caller's sandboxes by start time, paged, filtered."""
        owner = self._context.owner(request)
        limit = page_limit(request)
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
        template = _template_query(request.query_params.get("template") or None)
        started_after = _instant(request.query_params.get("startedAfter"))
        slug = team_slug(owner)

        def picks(sandbox: E2bSandbox) -> bool:
            return (template is None or _made_from(sandbox, template, slug)) and all(
                sandbox.metadata.get(k) == v for k, v in wanted_meta.items()
            )

        page, next_after = await self._context.sandboxes().listing.page(
            owner,
            after=after,
            limit=limit,
            order=order,
            states=sorted(wanted),
            started_after=started_after,
            picks=picks,
        )
        headers = None if next_after is None else {"X-Next-Token": page_token(next_after, order)}
        return json_response([self._listed(s) for s in page], headers=headers)

    async def list_v1(self, request: Request) -> Response:
        """E2B's first listing: the running sandboxes, newest first, unpaged, with the
        same ``metadata`` query as the second."""
        owner = self._context.owner(request)
        wanted_meta = _metadata_query(request)
        items = [
            s
            for s in reversed(await self._context.sandboxes().running_of(owner))
            if all(s.metadata.get(k) == v for k, v in wanted_meta.items())
        ]
        return json_response([self._listed(s) for s in items])

    async def detail(self, request: Request) -> Response:
        """E2B's ``get_info``: the listed view plus the envd token and the domain."""
        sandbox = await self._context.one(request)
        listed = self._listed(sandbox)
        detail = SandboxDetail(
            **msgspec.structs.asdict(listed),
            envdAccessToken=sandbox.access_token,
            domain=self._context.domain,
        )
        return json_response(detail)

    async def kill(self, request: Request) -> Response:
        """E2B's ``kill``."""
        await self._context.sandboxes().kill(await self._context.one(request))
        return Response(status_code=204)

    async def set_timeout(self, request: Request) -> Response:
        """E2B's ``set_timeout``: the sandbox ends ``timeout`` seconds from now."""
        sandbox = await self._context.one(request)
        message = await read_message(request, SetTimeout)
        await self._context.sandboxes().set_timeout(sandbox, message.timeout)
        return Response(status_code=204)

    async def update_network(self, request: Request) -> Response:
        """E2B's network update: the sandbox's egress policy, replaced."""
        sandbox = await self._context.one(request)
        message = await read_message(request, UpdateNetwork, empty_ok=True)
        policy = egress_policy(message.allow_internet_access, message.network())
        await self._context.sandboxes().set_network(sandbox, policy)
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        """E2B's ``pause``: 409 when the sandbox is paused already."""
        sandbox = await self._context.one(request)
        await read_message(request, PauseSandbox, empty_ok=True)
        if not await self._context.sandboxes().pause(sandbox):
            raise E2bError(409, "session_conflict", f"sandbox {sandbox.sandbox_id} is paused")
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        """E2B's ``connect``: 200 for a running sandbox, 201 for one it resumed."""
        sandbox = await self._context.one(request)
        message = await read_message(request, ConnectSandbox, empty_ok=True)
        was_paused = sandbox.state == "paused"
        await self._context.sandboxes().connect(sandbox, timeout_s=message.timeout)
        return json_response(self._context.created(sandbox), 201 if was_paused else 200)

    async def resume(self, request: Request) -> Response:
        """E2B's older ``resume``: 409 for a running sandbox."""
        sandbox = await self._context.one(request)
        message = await read_message(request, ConnectSandbox, empty_ok=True)
        if sandbox.state != "paused":
            raise E2bError(409, "session_conflict", f"sandbox {sandbox.sandbox_id} is running")
        await self._context.sandboxes().connect(sandbox, timeout_s=message.timeout)
        return json_response(self._context.created(sandbox), 201)
