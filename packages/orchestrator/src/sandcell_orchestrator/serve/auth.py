"""Authentication for ``sandcell serve``: bearer API key -> tenant namespace.

Each API key (``SANDCELL_API_KEYS``) maps to a namespace; keys are compared in
constant time as SHA-256 digests and never logged or shown in a repr. Without
keys the service refuses to start, unless ``SANDCELL_SERVE_INSECURE_NO_AUTH=1``
(never in production) serves every caller as one namespace.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping

from starlette.requests import Request

from ..config import INSECURE_NO_AUTH_ENV, OrchestratorSettings
from ..errors import ConfigError

__all__ = [
    "INSECURE_NAMESPACE",
    "INSECURE_NO_AUTH_ENV",
    "ApiKeys",
    "UnauthorizedError",
    "load_api_keys",
]

log = logging.getLogger(__name__)

INSECURE_NAMESPACE = "default"


class UnauthorizedError(Exception):
    """No or an unknown bearer key: answered 401 ``unauthorized`` (the key is never shown)."""


class _ApiKeys:
    """Bearer API key -> namespace, compared in constant time over every key."""

    def __init__(self, keys: Mapping[str, str], *, insecure: bool) -> None:
        # Digests have one length, so compare_digest's time says nothing about a
        # key's length either.
        self._digests = [(_digest(key), namespace) for key, namespace in keys.items()]
        self._insecure = insecure

    def __repr__(self) -> str:
        return f"_ApiKeys(<{len(self._digests)} keys>, insecure={self._insecure})"

    def namespace(self, request: Request) -> str:
        """The namespace of the request's bearer key; ``UnauthorizedError`` otherwise."""
        scheme, _, credential = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            credential = ""
        return self.namespace_of_key(credential)

    def namespace_of_key(self, credential: str | None) -> str:
        """The namespace of an API key however it was sent (E2B's SDK: ``X-API-KEY``)."""
        if self._insecure:
            return INSECURE_NAMESPACE
        if credential is None or not credential.strip():
            raise UnauthorizedError
        offered = _digest(credential.strip())
        found = None
        for digest, namespace in self._digests:
            if hmac.compare_digest(offered, digest) and found is None:
                found = namespace
        if found is None:
            raise UnauthorizedError
        return found

    @property
    def insecure(self) -> bool:
        """Serving without keys (``SANDCELL_SERVE_INSECURE_NO_AUTH=1``)."""
        return self._insecure


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


ApiKeys = _ApiKeys
"""The type ``load_api_keys`` returns."""


def load_api_keys(settings: OrchestratorSettings) -> _ApiKeys:
    """Refuse to serve without keys, unless explicitly told to (never in production)."""
    if settings.serve.api_keys:
        return _ApiKeys(settings.serve.api_keys, insecure=False)
    if not settings.serve.insecure_no_auth:
        raise ConfigError(
            f"sandcell serve needs SANDCELL_API_KEYS (key=namespace,...); "
            f"{INSECURE_NO_AUTH_ENV}=1 serves without auth outside production"
        )
    if settings.production:
        raise ConfigError(f"{INSECURE_NO_AUTH_ENV}=1 is refused when SANDCELL_ENV=production")
    log.warning("serving WITHOUT authentication (%s=1)", INSECURE_NO_AUTH_ENV)
    return _ApiKeys({}, insecure=True)
