"""``S3Settings``: where a snapshot bucket is and how to reach it, from the environment.

Validated once at start-up (``from_env``), with errors that name the variable;
the secret key never appears in a repr.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import SplitResult, urlsplit

from ..errors import ConfigError
from .keys import KEY_COMPONENT

__all__ = ["S3Settings"]

_MIB = 1 << 20
_MIN_PART_BYTES = 5 * _MIB
_MAX_PART_BYTES = 5 * 1024 * _MIB
_MINIO_PORT = 9000
_AWS_ENDPOINT = "https://s3.amazonaws.com"
_ENDPOINT_VARS = ("SANDCELL_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_REGION_VARS = ("SANDCELL_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
# Pairs, taken together: a key from one source never meets a secret from another.
_CREDENTIAL_VARS = (
    ("SANDCELL_S3_ACCESS_KEY", "SANDCELL_S3_SECRET_KEY"),
    ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"),
)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_REGION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?")
_HOST = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class S3Settings:
    """Where the bucket is and how to reach it; ``from_env`` builds it from the environment.

    ``endpoint`` is ``http(s)://host[:port]`` (the scheme decides ``secure``; no port
    means the scheme's) or a bare ``host[:port]`` (``secure`` as given; no port means
    MinIO's 9000). Construction normalizes it to ``host:port``. ``secret_key`` never
    appears in a repr, a log line or an error message. A put holds about three
    ``part_size_bytes`` in memory (minio copies a part while assembling it).
    """

    endpoint: str
    bucket: str
    prefix: str = ""
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    region: str = "us-east-1"
    secure: bool = True
    part_size_bytes: int = 5 * _MIB
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        endpoint, secure = _parse_endpoint(self.endpoint, secure=self.secure, name="endpoint")
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "secure", secure)
        object.__setattr__(self, "prefix", _parse_prefix(self.prefix, name="prefix"))
        if not _BUCKET.fullmatch(self.bucket):
            raise ConfigError("bucket: must be an S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
        if not _REGION.fullmatch(self.region):
            raise ConfigError("region: must be a region name like us-east-1")
        if (self.access_key is None) != (self.secret_key is None):
            raise ConfigError("access_key, secret_key: set both or neither")
        if not _MIN_PART_BYTES <= self.part_size_bytes <= _MAX_PART_BYTES:
            raise ConfigError("part_size_bytes: must be between 5 MiB and 5 GiB")
        if not (self.connect_timeout_s > 0 and self.read_timeout_s > 0):
            raise ConfigError("connect_timeout_s, read_timeout_s: must be positive")

    @property
    def url(self) -> str:
        """The endpoint as a URL, for messages."""
        return f"{'https' if self.secure else 'http'}://{self.endpoint}"

    @classmethod
    def from_env(cls, env: Mapping[str, str], url: str) -> S3Settings:
        """Settings for ``url`` (``s3://bucket/prefix``) from ``env``.

        Reads ``SANDCELL_S3_ENDPOINT`` (else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
        else AWS itself), the key pair ``SANDCELL_S3_ACCESS_KEY`` / ``SANDCELL_S3_SECRET_KEY``
        (else ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, else ``MINIO_ROOT_USER`` /
        ``MINIO_ROOT_PASSWORD``) and ``SANDCELL_S3_REGION`` (else ``AWS_REGION``,
        ``AWS_DEFAULT_REGION``, else us-east-1). A bad value raises ``ConfigError``
        naming its variable; a secret's value is never echoed.
        """
        bucket, prefix = _parse_s3_url(url)
        endpoint_var, raw_endpoint = _first_set(env, *_ENDPOINT_VARS)
        endpoint, secure = _parse_endpoint(
            raw_endpoint or _AWS_ENDPOINT, secure=True, name=endpoint_var
        )
        region_var, region = _first_set(env, *_REGION_VARS)
        if region is not None and not _REGION.fullmatch(region):
            raise ConfigError(f"{region_var}: must be a region name like us-east-1")
        access_key, secret_key = _credentials(env)
        return cls(
            endpoint=endpoint,
            bucket=bucket,
            prefix=prefix,
            access_key=access_key,
            secret_key=secret_key,
            region=region or "us-east-1",
            secure=secure,
        )


def _parse_endpoint(value: str, *, secure: bool, name: str) -> tuple[str, bool]:
    text = value.strip()
    if not text:
        raise ConfigError(f"{name}: must not be empty")
    if "://" in text:
        parts = urlsplit(text)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigError(f"{name}: the scheme must be http or https")
        secure = scheme == "https"
        default_port = 443 if secure else 80
    else:
        # "//" makes urlsplit read a bare "host:port" as a netloc, not as "scheme:path".
        parts = urlsplit("//" + text)
        default_port = _MINIO_PORT
    return _netloc(parts, default_port=default_port, name=name), secure


def _netloc(parts: SplitResult, *, default_port: int, name: str) -> str:
    if "@" in parts.netloc:
        raise ConfigError(f"{name}: must not carry credentials")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{name}: must be scheme://host[:port] or host[:port], with no path")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{name}: the port must be a number from 1 to 65535") from None
    host = parts.hostname or ""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{name}: invalid IPv6 address") from None
        host = f"[{host}]"
    elif not _HOST.fullmatch(host):
        raise ConfigError(f"{name}: invalid host name")
    if port == 0:
        raise ConfigError(f"{name}: the port must be a number from 1 to 65535")
    return f"{host}:{port or default_port}"


def _parse_s3_url(url: str) -> tuple[str, str]:
    parts = urlsplit(url.strip())
    if parts.scheme.lower() != "s3" or parts.query or parts.fragment:
        raise ConfigError("snapshot store URL: must be s3://bucket/prefix")
    if not _BUCKET.fullmatch(parts.netloc):
        raise ConfigError("snapshot store URL: the bucket must be an S3 bucket name")
    return parts.netloc, _parse_prefix(parts.path, name="snapshot store URL")


def _parse_prefix(value: str, *, name: str) -> str:
    prefix = value.strip("/")
    if prefix and not all(KEY_COMPONENT.fullmatch(part) for part in prefix.split("/")):
        raise ConfigError(f"{name}: prefix components must match [A-Za-z0-9_][A-Za-z0-9._-]*")
    return prefix


def _first_set(env: Mapping[str, str], *names: str) -> tuple[str, str | None]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return names[0], None


def _credentials(env: Mapping[str, str]) -> tuple[str, str]:
    for access_var, secret_var in _CREDENTIAL_VARS:
        access = env.get(access_var, "").strip()
        secret = env.get(secret_var, "").strip()
        if not access and not secret:
            continue
        if not access:
            raise ConfigError(f"{access_var}: not set, but {secret_var} is")
        if not secret:
            raise ConfigError(f"{secret_var}: not set, but {access_var} is")
        for var, value in ((access_var, access), (secret_var, secret)):
            if not value.isprintable() or any(c.isspace() for c in value):
                raise ConfigError(f"{var}: must not contain whitespace or control characters")
        return access, secret
    names = ", ".join(access for access, _ in _CREDENTIAL_VARS[1:])
    raise ConfigError(f"{_CREDENTIAL_VARS[0][0]}: not set (nor {names})")
