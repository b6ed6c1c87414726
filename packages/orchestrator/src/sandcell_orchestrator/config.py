"""The orchestrator's configuration: read once from the environment, validated at start-up.

With no configuration at all sandcell runs embedded on one machine: the local
provider, an in-process registry and a snapshot directory under ``SANDCELL_HOME``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from sandcell_protocol import validate_hint

from .errors import ConfigError

T = TypeVar("T")
SessionMode = Literal["stateless", "affinity", "strict"]
ProviderName = Literal["local", "docker", "lambda-microvm"]
_MODES: tuple[SessionMode, ...] = ("stateless", "affinity", "strict")
_PROVIDERS: tuple[ProviderName, ...] = ("local", "docker", "lambda-microvm")


@dataclass(frozen=True, slots=True)
class Budgets:
    """Time budgets of one turn; the session lock's TTL is derived from them."""

    launch_s: float = 30.0
    health_s: float = 15.0
    execute_s: float = 300.0
    checkpoint_s: float = 120.0


@dataclass(frozen=True, slots=True)
class OrchestratorSettings:
    """Everything the orchestrator is configured with. Build with ``from_env``."""

    home: Path = field(default_factory=lambda: Path.home() / ".local" / "share" / "sandcell")
    provider: ProviderName = "local"
    registry_url: str | None = field(default=None, repr=False)
    snapshot_url: str | None = None
    session_mode: SessionMode = "affinity"
    production: bool = False
    budgets: Budgets = field(default_factory=Budgets)
    checkpoint_max_bytes: int = 1 << 30
    idle_timeout_s: float = 1800.0
    sweep_interval_s: float = 60.0
    local_pool_size: int = 0
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    serve_host: str = "127.0.0.1"
    serve_port: int = 8000
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    """The environment this was read from, for provider-specific settings."""

    @property
    def state_dir(self) -> Path:
        """Where the local provider keeps its runners' roots."""
        return self.home / "sandboxes"

    @property
    def snapshot_dir(self) -> Path:
        return self.home / "snapshots"

    @property
    def inputs_dir(self) -> Path:
        return self.home / "inputs"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OrchestratorSettings:
        """Read ``SANDCELL_*`` variables; ``ConfigError`` names the variable at fault."""
        read = _Reader(env)
        home_default = Path(env.get("HOME", str(Path.home()))) / ".local" / "share" / "sandcell"
        home = read.path("SANDCELL_HOME", home_default)
        provider = read.choice("SANDCELL_PROVIDER", _PROVIDERS, "local")
        mode = read.choice("SANDCELL_RUNTIME_SESSION_MODE", _MODES, "affinity")
        registry_url = env.get("SANDCELL_REGISTRY_URL") or None
        if registry_url is not None and not registry_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError("SANDCELL_REGISTRY_URL must be a redis://, rediss:// or unix:// URL")
        snapshot_url = env.get("SANDCELL_SNAPSHOT_URL") or None
        if snapshot_url is not None and not snapshot_url.startswith(("s3://", "file://")):
            raise ConfigError("SANDCELL_SNAPSHOT_URL must be s3://bucket/prefix or file:///path")
        return cls(
            home=home,
            provider=provider,
            registry_url=registry_url,
            snapshot_url=snapshot_url,
            session_mode=mode,
            production=env.get("SANDCELL_ENV", "").lower() == "production",
            budgets=Budgets(
                launch_s=read.number("SANDCELL_LAUNCH_TIMEOUT_S", 30.0),
                health_s=read.number("SANDCELL_HEALTH_TIMEOUT_S", 15.0),
                execute_s=read.number("SANDCELL_EXECUTE_TIMEOUT_S", 300.0),
                checkpoint_s=read.number("SANDCELL_CHECKPOINT_TIMEOUT_S", 120.0),
            ),
            checkpoint_max_bytes=int(read.number("SANDCELL_CHECKPOINT_MAX_BYTES", float(1 << 30))),
            idle_timeout_s=read.number("SANDCELL_IDLE_TIMEOUT_S", 1800.0),
            sweep_interval_s=read.number("SANDCELL_SWEEP_INTERVAL_S", 60.0),
            local_pool_size=int(read.number("SANDCELL_LOCAL_POOL_SIZE", 0.0, minimum=0)),
            api_keys=_api_keys(env.get("SANDCELL_API_KEYS", "")),
            serve_host=env.get("SANDCELL_SERVE_HOST", "127.0.0.1"),
            serve_port=int(read.number("SANDCELL_SERVE_PORT", 8000.0, minimum=0)),
            env=dict(env),
        )


def _api_keys(raw: str) -> dict[str, str]:
    """``key=namespace,key2=namespace2``: each API key maps to a tenant namespace."""
    keys: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, namespace = item.partition("=")
        if not sep or len(key) < 16 or not namespace:
            raise ConfigError(
                "SANDCELL_API_KEYS must be key=namespace pairs, keys of at least 16 characters"
            )
        try:
            validate_hint(namespace)
        except ValueError:
            raise ConfigError("SANDCELL_API_KEYS: a namespace has invalid characters") from None
        keys[key] = namespace
    return keys


class _Reader:
    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    def _get(self, name: str, default: T, parse: Callable[[str], T]) -> T:
        raw = self._env.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            return parse(raw.strip())
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    def number(self, name: str, default: float, *, minimum: float = 0.001) -> float:
        def parse(raw: str) -> float:
            value = float(raw)
            if value < minimum:
                raise ValueError(f"must be >= {minimum}, got {raw!r}")
            return value

        return self._get(name, default, parse)

    def path(self, name: str, default: Path) -> Path:
        def parse(raw: str) -> Path:
            path = Path(os.path.expanduser(raw))
            if not path.is_absolute():
                raise ValueError(f"must be an absolute path, got {raw!r}")
            return path

        return self._get(name, default, parse)

    def choice(self, name: str, options: tuple[T, ...], default: T) -> T:
        def parse(raw: str) -> T:
            for option in options:
                if raw == option:
                    return option
            raise ValueError(f"must be one of {', '.join(map(str, options))}, got {raw!r}")

        return self._get(name, default, parse)
