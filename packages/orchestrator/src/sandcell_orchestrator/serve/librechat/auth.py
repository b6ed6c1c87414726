"""Who calls ``/librechat/v1``: an API key (three ways) or a LibreChat JWT.

- ``X-API-Key: <key>`` (what LibreChat sends), ``Authorization: Bearer <key>``, or,
  from legacy clients, the key copied into the exec body as
  ``LIBRECHAT_CODE_API_KEY``: all against ``SANDCELL_API_KEYS``; the key's
  namespace is the tenant. The key is never logged, echoed or kept. Headers are
  checked first; only a call they do not authenticate has its body read for a key,
  and then at most ``BODY_KEY_MAX_BYTES`` of it (``exec_routes.py``).
- ``Authorization: Bearer <JWT>`` signed by LibreChat (``jwt.py``): the token's user is
  the caller's user, and its ``tenant_id`` picks the namespace (``jwt_tenant_namespace``):
  ``SANDCELL_LIBRECHAT_JWT_NAMESPACE`` for LibreChat's single tenant (``legacy``, or no
  ``tenant_id``), a namespace of its own for every other tenant, so LibreChat's tenants
  are walls as API-key tenants are.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from starlette.requests import Request

from ..auth import ApiKeys, UnauthorizedError
from .jwt import JwtVerifier, looks_like_jwt

__all__ = ["SINGLE_TENANT_ID", "Caller", "LibreChatAuth", "jwt_tenant_namespace"]

SINGLE_TENANT_ID = "legacy"
"""The ``tenant_id`` LibreChat signs when it runs a single tenant (its default)."""
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def jwt_tenant_namespace(base: str, tenant: str | None) -> str:
    """The namespace of a token's LibreChat tenant.

    ``base`` (``SANDCELL_LIBRECHAT_JWT_NAMESPACE``) for the single tenant or none, so a
    deployment that turns tenants on keeps its files where they were; ``<base>:<tenant>``
    for another tenant whose id fits a namespace, else ``<base>:t-<digest of the id>``
    (an id is LibreChat's, any text: it must neither be refused nor meet another's).
    """
    if tenant is None or tenant == SINGLE_TENANT_ID:
        return base
    named = f"{base}:{tenant}"
    if _NAMESPACE_RE.fullmatch(named) and not tenant.startswith("t-"):
        return named
    return f"{base}:t-{hashlib.sha256(tenant.encode('utf-8', 'surrogatepass')).hexdigest()[:40]}"


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
            principal = self._verifier.principal_of(bearer)
            if principal is not None:
                namespace = jwt_tenant_namespace(self._jwt_namespace, principal.tenant)
                return Caller(namespace=namespace, token_user=principal.user)
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
