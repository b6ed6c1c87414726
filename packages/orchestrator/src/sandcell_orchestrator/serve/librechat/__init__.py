"""LibreChat's Code Interpreter API under ``/librechat/v1``: an adapter, mounted by one line.

Point LibreChat at it with ``LIBRECHAT_CODE_BASEURL=http://HOST:PORT/librechat/v1``;
see ``docs/librechat.md``. ``routes.py`` has the route table; ``api.py`` the state
the routes share; ``auth.py``/``jwt.py`` who may call; ``files.py`` where uploads
and outputs are kept; ``wire.py`` the shapes; ``errors.py`` the status mapping the client expects.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette
from starlette.routing import Mount

from ...bootstrap import Services
from ..auth import ApiKeys
from .api import LibreChatApi
from .auth import LibreChatAuth
from .jwt import JwtVerifier
from .routes import librechat_routes
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
    app.router.routes.append(Mount(MOUNT_PATH, routes=librechat_routes(api)))
    return api
