"""Who calls ``/librechat/v1``: an API key (three ways) or a LibreChat JWT.

- ``X-API-Key: <key>`` (what LibreChat sends), ``Authorization: Bearer <key>``, or,
  from legacy clients, the key copied into the exec body as
  ``LIBRECHAT_CODE_API_KEY``: all against ``SANDCELL_API_KEYS``; the key's
  namespace is the tenant. The key is never logged, echoed or kept. Headers are
  checked first; only a call they do not authenticate has its body read for a key,
  and then at most ``BODY_KEY_MAX_BYTES`` of it (``routes.py``).
- ``Authorization: Bearer <JWT>`` signed by LibreChat (``jwt.py``): the tenant is
  ``SANDCELL_LIBRECHAT_JWT_NAMESPACE`` and the token's user is the caller's user.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from ..auth import ApiKeys, UnauthorizedError
from .jwt import JwtVerifier, looks_like_jwt

__all__ = ["Caller", "LibreChatAuth"]


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller: its tenant, and its user when a token vouches for one."""

    namespace: str
    token_user: str | None = None
    """The JWT's user; ``None`` for API-key callers (they name users in the request)."""


class LibreChatAuth:
    """Resolves a request's headers (or a legacy body key) to a ``Caller``."""

    def __init__(self, keys: ApiKeys, verifier: JwtVerifier, *, jwt_namespace: str) -> None:
        self._keys = keys
        self._verifier = verifier
        self._jwt_namespace = jwt_namespace

    def __repr__(self) -> str:
        return f"LibreChatAuth({self._keys!r}, {self._verifier!r})"

    def caller(self, request: Request) -> Caller:
        """The caller its headers name; ``UnauthorizedError`` otherwise."""
        caller = self.header_caller(request)
        if caller is None:
            raise UnauthorizedError
        return caller

    def header_caller(self, request: Request) -> Caller | None:
        """The caller its headers name, or ``None`` (a legacy body key may still name one)."""
        if self._keys.insecure:
            return Caller(namespace=self._keys.namespace_of_key(None))
        scheme, _, credential = request.headers.get("authorization", "").partition(" ")
        bearer = credential.strip() if scheme.lower() == "bearer" else ""
        for key in (request.headers.get("x-api-key", ""), bearer):
            namespace = self._namespace(key)
            if namespace is not None:
                return Caller(namespace=namespace)
        if bearer and self._verifier.enabled and looks_like_jwt(bearer):
            user = self._verifier.user_of(bearer)
            if user is not None:
                return Caller(namespace=self._jwt_namespace, token_user=user)
        return None

    def body_key_caller(self, body_key: str | None) -> Caller:
        """The caller a legacy body key names; ``UnauthorizedError`` otherwise."""
        namespace = self._namespace(body_key or "")
        if namespace is None:
            raise UnauthorizedError
        return Caller(namespace=namespace)

    def _namespace(self, key: str) -> str | None:
        if not key.strip():
            return None
        try:
            return self._keys.namespace_of_key(key)
        except UnauthorizedError:
            return None
