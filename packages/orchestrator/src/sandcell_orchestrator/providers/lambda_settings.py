"""Typed settings of the Lambda MicroVM provider and its start-up policy check.

Read once at start-up (by ``OrchestratorSettings.from_env``, through the shared
``EnvReader``); the provider takes the settings object. Constructing one runs the policy check, so
an invalid configuration cannot exist: every ``ConfigError`` names the variable.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..env import EnvReader
from ..errors import ConfigError

__all__ = ["ENV", "MAX_TOKEN_MINUTES", "LambdaMicrovmSettings"]

MAX_TOKEN_MINUTES = 60
"""``CreateMicrovmAuthToken`` refuses longer lifetimes."""
_MAX_DURATION_S = 28_800
"""A MicroVM lives at most 8 hours (``maximumDurationInSeconds``)."""
_MIN_IDLE_S = 60
"""``idlePolicy.maxIdleDurationSeconds`` has a minimum of 60 in the service model."""
_MAX_CONNECTORS = 10
_MIN_RUNNER_KEY_CHARS = 32


class ENV:
    """The variable names, so messages and the documentation agree."""

    IMAGE = "SANDCELL_MICROVM_IMAGE"
    IMAGE_VERSION = "SANDCELL_MICROVM_IMAGE_VERSION"
    ROLE_ARN = "SANDCELL_MICROVM_ROLE_ARN"
    EGRESS_CONNECTORS = "SANDCELL_MICROVM_EGRESS_CONNECTORS"
    INGRESS_CONNECTORS = "SANDCELL_MICROVM_INGRESS_CONNECTORS"
    ENDPOINT_URL = "SANDCELL_MICROVM_ENDPOINT_URL"
    REGION = "SANDCELL_MICROVM_REGION"
    TOKEN_MINUTES = "SANDCELL_MICROVM_TOKEN_MINUTES"  # noqa: S105
    BOOT_TIMEOUT_S = "SANDCELL_MICROVM_BOOT_TIMEOUT_S"
    MAX_DURATION_S = "SANDCELL_MICROVM_MAX_DURATION_S"
    RETENTION_S = "SANDCELL_MICROVM_RETENTION_S"
    TPS = "SANDCELL_MICROVM_TPS"
    RUNNER_PORT = "SANDCELL_MICROVM_RUNNER_PORT"
    RUNNER_KEY = "SANDCELL_MICROVM_RUNNER_KEY"
    POLL_INTERVAL_S = "SANDCELL_MICROVM_POLL_INTERVAL_S"
    IDLE_TIMEOUT_S = "SANDCELL_IDLE_TIMEOUT_S"
    REGISTRY_URL = "SANDCELL_REGISTRY_URL"
    SANDCELL_ENV = "SANDCELL_ENV"


@dataclass(frozen=True, slots=True)
class LambdaMicrovmSettings:
    """Everything the ``lambda-microvm`` provider is configured with.

    ``runner_key`` derives each VM's runner token (HMAC of a per-launch nonce), so
    every orchestrator worker sharing the key can talk to every VM; unset outside
    production, the provider makes a random one and only it can reach its VMs.
    """

    image: str
    kind: Literal["lambda-microvm"] = "lambda-microvm"
    image_version: str | None = None
    execution_role_arn: str | None = None
    egress_connectors: tuple[str, ...] = ()
    ingress_connectors: tuple[str, ...] = ()
    endpoint_url: str | None = None
    region: str | None = None
    token_minutes: int = MAX_TOKEN_MINUTES
    boot_timeout_s: float = 60.0
    max_duration_s: int = _MAX_DURATION_S
    retention_s: int = 3_600
    tps: float = 5.0
    idle_timeout_s: int = 1_800
    runner_port: int = 8080
    poll_interval_s: float = 1.0
    runner_key: str | None = field(default=None, repr=False)
    # A Redis URL may carry a password.
    redis_url: str | None = field(default=None, repr=False)
    production: bool = False

    def __post_init__(self) -> None:
        _check_policy(self)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LambdaMicrovmSettings:
        """Read the ``SANDCELL_MICROVM_*`` variables (and the shared ones it needs)."""
        read = EnvReader(env)
        registry_url = read.text(ENV.REGISTRY_URL)
        redis_url = None
        if registry_url is not None and registry_url.startswith(("redis://", "rediss://")):
            redis_url = registry_url
        return cls(
            image=read.text(ENV.IMAGE) or "",
            image_version=read.text(ENV.IMAGE_VERSION),
            execution_role_arn=read.text(ENV.ROLE_ARN),
            egress_connectors=read.csv(ENV.EGRESS_CONNECTORS),
            ingress_connectors=read.csv(ENV.INGRESS_CONNECTORS),
            endpoint_url=read.text(ENV.ENDPOINT_URL),
            region=read.text(ENV.REGION),
            token_minutes=read.parse(ENV.TOKEN_MINUTES, MAX_TOKEN_MINUTES, _integer),
            boot_timeout_s=read.parse(ENV.BOOT_TIMEOUT_S, 60.0, _number),
            max_duration_s=read.parse(ENV.MAX_DURATION_S, _MAX_DURATION_S, _integer),
            retention_s=read.parse(ENV.RETENTION_S, 3_600, _integer),
            tps=read.parse(ENV.TPS, 5.0, _number),
            idle_timeout_s=read.parse(ENV.IDLE_TIMEOUT_S, 1_800, _whole_seconds),
            runner_port=read.parse(ENV.RUNNER_PORT, 8080, _integer),
            poll_interval_s=read.parse(
                ENV.POLL_INTERVAL_S, _default_poll_s(read.text(ENV.ENDPOINT_URL)), _number
            ),
            runner_key=read.text(ENV.RUNNER_KEY),
            redis_url=redis_url,
            production=read.production(),
        )

    @property
    def token_lifetime_s(self) -> float:
        """How long a minted proxy token is valid."""
        return self.token_minutes * 60.0


def _default_poll_s(endpoint_url: str | None) -> float:
    """1 s against AWS (each poll spends the account's API rate); 0.1 s against an
    emulator on this host, where a poll is free and a 1 s poll doubled a cold start."""
    host = urllib.parse.urlsplit(endpoint_url or "").hostname or ""
    return 0.1 if host in ("127.0.0.1", "localhost", "::1") else 1.0


def _check_policy(s: LambdaMicrovmSettings) -> None:
    """The start-up policy: refuse what would fail later, or run unsafely in production."""
    if not s.image.strip():
        raise ConfigError(f"{ENV.IMAGE} is required: the MicroVM image (ARN) to launch")
    if s.production and not s.image.startswith("arn:"):
        raise ConfigError(
            f"{ENV.IMAGE} must be the image ARN under {ENV.SANDCELL_ENV}=production "
            "(RunMicrovm rejects bare image names)"
        )
    if s.production and not s.egress_connectors:
        raise ConfigError(
            f"{ENV.EGRESS_CONNECTORS} is required under {ENV.SANDCELL_ENV}=production: "
            "untrusted code must leave the MicroVM only through a connector you control"
        )
    for name, connectors in (
        (ENV.EGRESS_CONNECTORS, s.egress_connectors),
        (ENV.INGRESS_CONNECTORS, s.ingress_connectors),
    ):
        if len(connectors) > _MAX_CONNECTORS:
            raise ConfigError(f"{name}: at most {_MAX_CONNECTORS} connector ARNs")
        if any(not c.startswith("arn:") for c in connectors):
            raise ConfigError(f"{name}: a comma-separated list of network connector ARNs")
    if s.execution_role_arn is not None and not s.execution_role_arn.startswith("arn:"):
        raise ConfigError(f"{ENV.ROLE_ARN}: an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME)")
    if not 1 <= s.token_minutes <= MAX_TOKEN_MINUTES:
        raise ConfigError(
            f"{ENV.TOKEN_MINUTES} must be between 1 and {MAX_TOKEN_MINUTES} "
            f"(CreateMicrovmAuthToken's limit), got {s.token_minutes}"
        )
    if s.boot_timeout_s <= 0:
        raise ConfigError(f"{ENV.BOOT_TIMEOUT_S} must be positive")
    if not 1 <= s.max_duration_s <= _MAX_DURATION_S:
        raise ConfigError(f"{ENV.MAX_DURATION_S} must be between 1 and {_MAX_DURATION_S}")
    if s.retention_s < 0:
        raise ConfigError(f"{ENV.RETENTION_S} must be >= 0")
    if s.tps <= 0:
        raise ConfigError(f"{ENV.TPS} must be positive")
    if s.idle_timeout_s < _MIN_IDLE_S:
        raise ConfigError(
            f"{ENV.IDLE_TIMEOUT_S} must be >= {_MIN_IDLE_S} for the MicroVM idle policy"
        )
    if not 1 <= s.runner_port <= 65_535:
        raise ConfigError(f"{ENV.RUNNER_PORT} must be a TCP port (1..65535)")
    if s.poll_interval_s <= 0:
        raise ConfigError(f"{ENV.POLL_INTERVAL_S} must be positive")
    if s.endpoint_url is not None and not s.endpoint_url.startswith(("http://", "https://")):
        raise ConfigError(f"{ENV.ENDPOINT_URL} must be an http(s) URL")
    if s.production and s.endpoint_url is not None and not s.endpoint_url.startswith("https://"):
        raise ConfigError(f"{ENV.ENDPOINT_URL} must use https under {ENV.SANDCELL_ENV}=production")
    if s.runner_key is not None and len(s.runner_key) < _MIN_RUNNER_KEY_CHARS:
        raise ConfigError(f"{ENV.RUNNER_KEY} must be at least {_MIN_RUNNER_KEY_CHARS} characters")
    if s.production and s.runner_key is None:
        raise ConfigError(
            f"{ENV.RUNNER_KEY} is required under {ENV.SANDCELL_ENV}=production: every "
            "worker derives a VM's runner token from it"
        )


def _whole_seconds(raw: str) -> int:
    """Seconds as the orchestrator's settings read them (a float), rounded up."""
    return math.ceil(_number(raw))


def _integer(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"must be an integer, got {raw[:32]!r}") from None


def _number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"must be a number, got {raw[:32]!r}") from None
