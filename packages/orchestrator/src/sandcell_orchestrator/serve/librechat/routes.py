"""The route table of ``/librechat/v1``: LibreChat's wire translated onto ``ExecutionService``.

    POST   /exec                               run code (stateless, or in a runtime session)
    POST   /exec/programmatic(/cancel)         code that calls the caller's tools
    POST   /upload, /upload/batch              keep files for later runs
    GET    /download/{session_id}/{fileId}     a file's bytes
    GET    /sessions/{session_id}/objects/{fileId}   {lastModified, size, etag}
    GET    /files/{session_id}                 the storage session's files
    DELETE /files/{session_id}/{fileId}        204
    GET    /health                             200, no auth

Each route's handler lives with what it owns: ``exec_routes`` (a run),
``programmatic`` (a run that pauses for tools), ``file_routes`` (uploads and
kept files); all share one ``LibreChatApi`` (``api.py``) and answer errors
through ``errors.librechat_guarded``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .api import LibreChatApi
from .errors import librechat_guarded, librechat_json
from .exec_routes import ExecRoutes
from .file_routes import FileRoutes
from .programmatic import Programmatic

__all__ = ["librechat_routes"]


def librechat_routes(api: LibreChatApi) -> list[Route]:
    """The routes of ``/librechat/v1``, every one on ``api``."""
    runs = ExecRoutes(api)
    programmatic = Programmatic(api)
    files = FileRoutes(api)
    g = librechat_guarded
    return [
        Route("/exec", g(runs.exec), methods=["POST"]),
        Route("/exec/programmatic", g(programmatic.handle), methods=["POST"]),
        Route("/exec/programmatic/cancel", g(programmatic.cancel), methods=["POST"]),
        Route("/upload", g(files.upload), methods=["POST"]),
        Route("/upload/batch", g(files.upload_batch), methods=["POST"]),
        Route("/download/{session_id}/{file_id}", g(files.download), methods=["GET"]),
        Route("/sessions/{session_id}/objects/{file_id}", g(files.object_info), methods=["GET"]),
        Route("/files/{session_id}", g(files.list_files), methods=["GET"]),
        Route("/files/{session_id}/{file_id}", g(files.delete_file), methods=["DELETE"]),
        Route("/health", g(_health), methods=["GET"]),
    ]


async def _health(_request: Request) -> Response:
    return librechat_json(200, {"status": "ok"})
