"""LibreChat's signed tokens: ``Authorization: Bearer <JWT>``, verified with joserfc.

A token is accepted only when it is signed (EdDSA or RS256, nothing else: no
``none``, no HMAC with a public key) by one of the operator's public keys, its
``iss`` is ``librechat`` and its ``aud`` includes ``codeapi``, it has ``exp`` and
``iat``, it is valid now (give or take ``CLOCK_SKEW_S``, for ``exp``, ``nbf`` and
``iat`` alike), and it lives at most 300 seconds (``exp - iat``). Its ``sub`` (or
``user_id``) becomes the caller's user, and its ``tenant_id`` (LibreChat's
tenant; ``legacy`` when LibreChat runs one) the caller's tenant (``auth.py``).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ...extras import needs_extra
from .settings import JWT_KEYS_ENV

__all__ = [
    "ALGORITHMS",
    "CLOCK_SKEW_S",
    "MAX_LIFETIME_S",
    "JwtVerifier",
    "TokenPrincipal",
    "looks_like_jwt",
]

ALGORITHMS = ("EdDSA", "RS256")
MAX_LIFETIME_S = 300
CLOCK_SKEW_S = 60
"""How far LibreChat's clock may run ahead of (or behind) this host's. LibreChat signs
``iat`` and ``nbf`` as its whole second *now* and sends the token at once: without a
leeway a host a millisecond behind it across a second's edge refuses a fresh token."""
ISSUER = "librechat"
AUDIENCE = "codeapi"


@dataclass(frozen=True, slots=True)
class TokenPrincipal:
    """Who a verified token names: its user, and its LibreChat tenant (``None``: none named)."""

    user: str
    tenant: str | None


def looks_like_jwt(credential: str) -> bool:
    """Three dot-separated parts: a JWT, not an API key (keys are checked first anyway)."""
    return credential.count(".") == 2


class JwtVerifier:
    """Verifies tokens against the configured keys; the clock is injected."""

    def __init__(self, key_texts: Sequence[str], *, clock: Callable[[], float] = time.time):
        self._keys: list[Any] = []
        self._clock = clock
        if not key_texts:
            return
        with needs_extra("librechat", JWT_KEYS_ENV):
            from joserfc.errors import JoseError
            from joserfc.jwk import KeySet, OKPKey, RSAKey
        for text in key_texts:
            try:
                if text.lstrip().startswith("{"):
                    data = json.loads(text)
                    found = data.get("keys", [data])
                    self._keys.extend(KeySet.import_key_set({"keys": found}).keys)
                else:
                    self._keys.append(_import_pem(text, JoseError, RSAKey, OKPKey))
            except (JoseError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f"{JWT_KEYS_ENV}: a key file is not a PEM public key or JWK"
                    f" ({type(exc).__name__})"
                ) from None

    def __repr__(self) -> str:
        return f"JwtVerifier(<{len(self._keys)} keys>)"

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def principal_of(self, token: str) -> TokenPrincipal | None:
        """Who the token names when it verifies, else ``None`` (never why: that is for logs).

        A ``tenant_id`` that is present but not a non-empty string refuses the token: a
        tenant must never be read as another (or as none)."""
        from joserfc import jwt
        from joserfc.errors import JoseError, SecurityWarning
        from joserfc.jwt import JWTClaimsRegistry

        now = int(self._clock())
        registry = JWTClaimsRegistry(
            now=now,
            leeway=CLOCK_SKEW_S,
            iss={"essential": True, "value": ISSUER},
            aud={"essential": True, "value": AUDIENCE},
            exp={"essential": True},
            iat={"essential": True},
        )
        for key in self._keys:
            try:
                with warnings.catch_warnings():
                    # joserfc warns that RFC 9864 deprecates the name "EdDSA" (for
                    # "Ed25519"); it is the name LibreChat signs with, so it is accepted.
                    warnings.simplefilter("ignore", SecurityWarning)
                    decoded = jwt.decode(token, key, algorithms=list(ALGORITHMS))
                claims = decoded.claims
                registry.validate(claims)
            except (JoseError, ValueError, TypeError):
                continue
            iat, exp = claims.get("iat"), claims.get("exp")
            if not isinstance(iat, int | float) or not isinstance(exp, int | float):
                return None
            if exp - iat > MAX_LIFETIME_S or iat > now + CLOCK_SKEW_S:
                return None
            user = claims.get("sub", claims.get("user_id"))
            tenant = claims.get("tenant_id")
            if not isinstance(user, str) or not user:
                return None
            if tenant is not None and (not isinstance(tenant, str) or not tenant):
                return None
            return TokenPrincipal(user=user, tenant=tenant)
        return None


def _import_pem(text: str, refused: type[Exception], *kinds: Any) -> Any:
    """The PEM public key as the first key type that takes it (RSA, then OKP)."""
    for kind in kinds[:-1]:
        try:
            return kind.import_key(text)
        except (refused, ValueError, TypeError):
            continue
    return kinds[-1].import_key(text)
