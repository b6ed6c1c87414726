"""E2B's metrics route: the samples a sandbox's runner took.

GET    /e2b/sandboxes/{id}/metrics       [SandboxMetric] (?start=&end=, unix seconds)

As E2B's (a query of its metrics store by team and sandbox id), a killed sandbox
answers the samples retired at its kill, and an id the caller never had (another
tenant's sandbox included) answers 200 ``[]``, not a 404.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol.sandbox_messages import MetricsQuery

from .control_context import ControlContext, guarded, iso, json_response
from .errors import E2bError
from .wire import SandboxMetric

__all__ = ["MetricRoutes"]

_MAX_UNIX_S = 10_413_791_999
"""2299-12-31T23:59:59Z: the latest time E2B's metrics take (its store's last date)."""


def _unix_seconds(request: Request, name: str) -> int | None:
    """``start`` or ``end`` of a metrics query: whole unix seconds, as the SDK sends them."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    # ASCII digits, few of them: ``int`` takes '²', '-1', ' 7' and 4300-digit strings.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 11) or int(raw) > _MAX_UNIX_S:
        raise E2bError(400, "bad_request", f"{name}: unix seconds, 0..{_MAX_UNIX_S}")
    return int(raw)


class MetricRoutes:
    """The route over one sandbox's metric samples."""

    def __init__(self, context: ControlContext) -> None:
        self._context = context

    def routes(self, prefix: str) -> list[BaseRoute]:
        """The metrics route under ``prefix``."""
        one = prefix + "/sandboxes/{sandbox_id}"
        return [Route(one + "/metrics", guarded(self.metrics), methods=["GET"])]

    async def metrics(self, request: Request) -> Response:
        """E2B's ``get_metrics``: the samples the sandbox's runner took in ``[start, end]``
        (every 5 s; both optional: since the sandbox started, until now); for a killed
        one those it retired, for an unknown one none."""
        start, end = _unix_seconds(request, "start"), _unix_seconds(request, "end")
        if start is not None and end is not None and start > end:
            raise E2bError(400, "bad_request", "start time cannot be after end time")
        query = MetricsQuery(start_s=start, end_s=end)
        sandboxes = self._context.sandboxes()
        try:
            sandbox = await self._context.one(request)
        except E2bError as exc:
            if exc.status != 404:
                raise
            # Gone, never made, or another tenant's: what the caller's own retired
            # samples hold under that id (none for the last two).
            owner = self._context.owner(request)
            sandbox_id = str(request.path_params["sandbox_id"])
            samples = await sandboxes.killed_metrics(owner, sandbox_id, query)
        else:
            samples = await sandboxes.metrics(sandbox, query)
        return json_response(
            [
                SandboxMetric(
                    timestamp=iso(s.at_s),
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
