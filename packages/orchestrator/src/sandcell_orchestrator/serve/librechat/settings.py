"""Configuration of LibreChat's Code Interpreter API (``/librechat/v1``), read at start-up.

=========================================== ============================================ ========
variable                                    meaning                                      default
=========================================== ============================================ ========
SANDCELL_LIBRECHAT_JWT_PUBLIC_KEYS          comma-separated files, each a PEM public key none (no
                                            (Ed25519 or RSA) or a JWK / JWK Set (JSON)   JWTs)
SANDCELL_LIBRECHAT_JWT_NAMESPACE            the tenant namespace of JWT callers          librechat
SANDCELL_LIBRECHAT_MAX_CONCURRENT           runs at once per tenant, across every worker 8
                                            on one registry; more answer 429
SANDCELL_LIBRECHAT_SLOT_TTL_S               how long a crashed worker's runs still count 30
                                            against the limit (slots are renewed every
                                            third of it while a run lasts)
SANDCELL_LIBRECHAT_DEFAULT_TIMEOUT_S        a run's limit when the call names none       60
SANDCELL_LIBRECHAT_MAX_TIMEOUT_S            the cap on a call's ``timeout``              280
SANDCELL_LIBRECHAT_MAX_UPLOAD_BYTES         the largest upload body                      150 MiB
SANDCELL_LIBRECHAT_MAX_OUTPUT_BYTES         the most of one run's output files kept      64 MiB
                                            (inline ones included); the rest is named
                                            in ``artifact_delivery``
=========================================== ============================================ ========

API keys are the service's (``SANDCELL_API_KEYS``). The timeout cap stays under the
300 s the client waits, so a run that overstays is answered (504) before the client
gives up on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sandcell_protocol import validate_hint

from ...env import EnvReader
from ...errors import ConfigError

__all__ = ["JWT_KEYS_ENV", "LibreChatSettings"]

JWT_KEYS_ENV = "SANDCELL_LIBRECHAT_JWT_PUBLIC_KEYS"


@dataclass(frozen=True, slots=True)
class LibreChatSettings:
    """How ``/librechat/v1`` authenticates and bounds its callers."""

    jwt_public_keys: tuple[str, ...] = field(default=(), repr=False)
    """The configured key files' texts (public keys: not secret, but long)."""
    jwt_namespace: str = "librechat"
    max_concurrent: int = 8
    slot_ttl_s: float = 30.0
    default_timeout_s: float = 60.0
    max_timeout_s: float = 280.0
    max_upload_bytes: int = 150 << 20
    max_output_bytes: int = 64 << 20

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LibreChatSettings:
        """Read ``SANDCELL_LIBRECHAT_*``; ``ConfigError`` names the variable."""
        read = EnvReader(env)
        texts = []
        for name in read.csv(JWT_KEYS_ENV):
            try:
                texts.append(Path(name).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{JWT_KEYS_ENV}: cannot read {name}: {exc}") from None
        namespace = read.text("SANDCELL_LIBRECHAT_JWT_NAMESPACE") or "librechat"
        try:
            validate_hint(namespace)
        except ValueError:
            raise ConfigError("SANDCELL_LIBRECHAT_JWT_NAMESPACE has invalid characters") from None
        default_timeout_s = read.number("SANDCELL_LIBRECHAT_DEFAULT_TIMEOUT_S", 60.0)
        max_timeout_s = read.number("SANDCELL_LIBRECHAT_MAX_TIMEOUT_S", 280.0)
        if default_timeout_s > max_timeout_s:
            raise ConfigError(
                "SANDCELL_LIBRECHAT_DEFAULT_TIMEOUT_S must not exceed"
                " SANDCELL_LIBRECHAT_MAX_TIMEOUT_S"
            )
        return cls(
            jwt_public_keys=tuple(texts),
            jwt_namespace=namespace,
            max_concurrent=read.integer("SANDCELL_LIBRECHAT_MAX_CONCURRENT", 8, minimum=1),
            slot_ttl_s=read.number("SANDCELL_LIBRECHAT_SLOT_TTL_S", 30.0),
            default_timeout_s=default_timeout_s,
            max_timeout_s=max_timeout_s,
            max_upload_bytes=read.integer(
                "SANDCELL_LIBRECHAT_MAX_UPLOAD_BYTES", 150 << 20, minimum=1
            ),
            max_output_bytes=read.integer(
                "SANDCELL_LIBRECHAT_MAX_OUTPUT_BYTES", 64 << 20, minimum=0
            ),
        )
