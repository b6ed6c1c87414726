"""LibreChat's Code Interpreter API under ``/librechat/v1``: an adapter, mounted by one line.

Point LibreChat at it with ``LIBRECHAT_CODE_BASEURL=http://HOST:PORT/librechat/v1``;
see ``docs/librechat.md``. ``routes.py`` has the route table; ``auth.py``/``jwt.py``
who may call; ``files.py`` where uploads and outputs are kept; ``wire.py`` the
shapes; ``errors.py`` the status mapping the client expects.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette
from starlette.routing import Mount, Route

from ...bootstrap import Services
from ..auth import ApiKeys
from .auth import LibreChatAuth
from .errors import librechat_guarded
from .jwt import JwtVerifier
from .programmatic import Programmatic
from .routes import LibreChatApi
from .settings import LibreChatSettings

__all__ = ["MOUNT_PATH", "LibreChatApi", "LibreChatSettings", "install_librechat"]

MOUNT_PATH = "/librechat/v1"


def install_librechat(
    app: Starlette,
    settings: LibreChatSettings,
    *,
    keys: ApiKeys,
    services: Callable[[], Services],
) -> LibreChatApi:
    """Mount the API on ``app`` (sharing its services and keys); returns its state.

    Building it checks the configured JWT keys (``ConfigError`` names the variable).
    """
    auth = LibreChatAuth(
        keys, JwtVerifier(settings.jwt_public_keys), jwt_namespace=settings.jwt_namespace
    )
    api = LibreChatApi(settings, auth=auth, services=services)
    programmatic = Programmatic(api)
    g = librechat_guarded
    routes = [
        Route("/exec", g(api.exec), methods=["POST"]),
        Route("/exec/programmatic", g(programmatic.handle), methods=["POST"]),
        Route("/exec/programmatic/cancel", g(programmatic.cancel), methods=["POST"]),
        Route("/upload", g(api.upload), methods=["POST"]),
        Route("/upload/batch", g(api.upload_batch), methods=["POST"]),
        Route("/download/{session_id}/{file_id}", g(api.download), methods=["GET"]),
        Route("/sessions/{session_id}/objects/{file_id}", g(api.object_info), methods=["GET"]),
        Route("/files/{session_id}", g(api.list_files), methods=["GET"]),
        Route("/files/{session_id}/{file_id}", g(api.delete_file), methods=["DELETE"]),
        Route("/health", g(api.health), methods=["GET"]),
    ]
    app.router.routes.append(Mount(MOUNT_PATH, routes=routes))
    return api
