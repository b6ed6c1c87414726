"""``/v1/session/files/{path}``: list, read, write and remove the bound session's files."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import FileListing, ProtocolError, routes, validate_workspace_path

from ..errors import BadRequestError, InvalidPathError
from .base import RouteGroup, json_response


class FileRoutes(RouteGroup):
    """The file routes; the work is ``RunnerService.files``."""

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(routes.SESSION_FILES, g(self.get_file), methods=["GET"]),
            Route(routes.SESSION_FILES, g(self.put_file), methods=["PUT"]),
            Route(routes.SESSION_FILES, g(self.delete_file), methods=["DELETE"]),
        ]

    async def get_file(self, request: Request) -> Response:
        session_id = self.required_session(request)
        found = await self.service.files.get(session_id, _path(request))
        if isinstance(found, FileListing):
            return json_response(found)
        return Response(found, media_type="application/octet-stream")

    async def put_file(self, request: Request) -> Response:
        session_id = self.required_session(request)
        relpath = _path(request)
        if not relpath:
            raise InvalidPathError("a file path is required")
        mode = _parse_mode(request.query_params.get("mode"))
        data = await self.read_body(request)
        entry = await self.service.files.put(session_id, relpath, data, mode=mode)
        self.service.apps.files_changed(session_id)
        return json_response(entry)

    async def delete_file(self, request: Request) -> Response:
        session_id = self.required_session(request)
        relpath = _path(request)
        if not relpath:
            raise InvalidPathError("a path is required")
        await self.service.files.remove(session_id, relpath)
        self.service.apps.files_changed(session_id)
        return Response(status_code=204)


def _path(request: Request) -> str:
    """The validated workspace path of the route (``""``: the workspace itself)."""
    raw = request.path_params.get("path", "")
    if raw in ("", "/"):
        return ""
    try:
        return validate_workspace_path(raw)
    except ProtocolError as exc:
        raise InvalidPathError(f"invalid path: {exc}") from None


def _parse_mode(raw: str | None) -> int:
    if raw is None:
        return 0o644
    try:
        mode = int(raw, 8)
    except ValueError:
        raise BadRequestError("mode must be an octal number such as 0644") from None
    if mode & ~0o777:
        raise BadRequestError("mode may only carry permission bits (no setuid/setgid/sticky)")
    return mode


__all__ = ["FileRoutes"]
