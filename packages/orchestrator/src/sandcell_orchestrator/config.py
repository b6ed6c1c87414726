"""The orchestrator's configuration: one object per process, read once at start-up.

``OrchestratorSettings.from_env(os.environ)`` reads every variable the process
uses through the shared ``EnvReader`` and validates it, so a bad value stops the
process at start-up with a ``ConfigError`` naming the variable; no raw
environment is kept. Its parts are typed sub-settings:

    provider   LocalSettings | DockerSettings | LambdaMicrovmSettings, tagged by
               ``kind`` (``SANDCELL_PROVIDER``: local | docker | lambda-microvm)
    s3         S3Settings, when ``SANDCELL_SNAPSHOT_URL`` is ``s3://…``
    apps       AppSettings (the app-instance API of ``sandcell serve``)
    librechat  LibreChatSettings (LibreChat's Code Interpreter API of ``sandcell serve``)
    serve      ServeSettings (listen address, API keys)

With no configuration at all sandcell runs embedded on one machine: the local
provider, a SQLite registry and a snapshot directory under ``SANDCELL_HOME``.
Only the chosen provider's settings module is imported.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from sandcell_protocol import validate_hint

from .env import EnvReader
from .errors import ConfigError
from .providers.local_settings import LocalSettings

if TYPE_CHECKING:
    from typing import TypeAlias

    from .apps.settings import AppSettings
    from .providers.docker_settings import DockerSettings
    from .providers.lambda_settings import LambdaMicrovmSettings
    from .runner.answers import AnswerCaps
    from .serve.librechat.settings import LibreChatSettings
    from .snapshots.s3_settings import S3Settings

    ProviderSettings: TypeAlias = LocalSettings | DockerSettings | LambdaMicrovmSettings
    """The provider's settings, a union tagged by ``kind`` (a ``ProviderName``)."""

__all__ = [
    "Budgets",
    "LogLevel",
    "OrchestratorSettings",
    "ProviderName",
    "ServeSettings",
    "SessionMode",
]

SessionMode = Literal["stateless", "affinity", "strict"]
ProviderName = Literal["local", "docker", "lambda-microvm"]
_MODES: tuple[SessionMode, ...] = ("stateless", "affinity", "strict")
_PROVIDERS: tuple[ProviderName, ...] = ("local", "docker", "lambda-microvm")
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
_LOG_LEVELS: tuple[LogLevel, ...] = ("critical", "error", "warning", "info", "debug")
INSECURE_NO_AUTH_ENV = "SANDCELL_SERVE_INSECURE_NO_AUTH"


@dataclass(frozen=True, slots=True)
class Budgets:
    """Time budgets of one turn, and the TTL of the session lock that guards it."""

    launch_s: float = 30.0
    health_s: float = 15.0
    execute_s: float = 300.0
    checkpoint_s: float = 120.0
    lock_ttl_s: float = 15.0
    """``SANDCELL_LOCK_TTL_S``: the session lock's TTL. Its holder renews it every third
    of that while the turn runs, so it need not cover the turn: it is how long a
    holder that died (a killed worker) keeps its session from everybody else."""


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """How ``sandcell serve`` listens and whom it serves."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    """API key -> tenant namespace (``SANDCELL_API_KEYS``)."""
    insecure_no_auth: bool = False
    """``SANDCELL_SERVE_INSECURE_NO_AUTH=1``: serve every caller as one namespace."""
    e2b_domain: str | None = None
    """``SANDCELL_E2B_DOMAIN``: also route E2B's ``api.{domain}`` / ``{port}-{id}.{domain}``."""
    e2b_max_running: int = 32
    """``SANDCELL_E2B_MAX_SANDBOXES``: running E2B sandboxes one tenant may hold."""
    e2b_max_snapshots: int = 100
    """``SANDCELL_E2B_MAX_SNAPSHOTS``: E2B snapshots one tenant may keep."""
    idempotency_ttl_s: float = 86_400.0
    """``SANDCELL_IDEMPOTENCY_TTL_S``: how long an ``Idempotency-Key``'s answer is kept."""
    idempotency_claim_ttl_s: float = 30.0
    """``SANDCELL_IDEMPOTENCY_CLAIM_TTL_S``: how long a dead worker's claim blocks retries."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ServeSettings:
        """Read ``SANDCELL_SERVE_*`` and ``SANDCELL_API_KEYS``."""
        read = EnvReader(env)
        return cls(
            host=read.text("SANDCELL_SERVE_HOST") or "127.0.0.1",
            port=read.integer("SANDCELL_SERVE_PORT", 8000, minimum=0, maximum=65535),
            api_keys=_api_keys(read.text("SANDCELL_API_KEYS") or ""),
            insecure_no_auth=read.text(INSECURE_NO_AUTH_ENV) == "1",
            e2b_domain=_e2b_domain(read.text("SANDCELL_E2B_DOMAIN")),
            e2b_max_running=read.integer("SANDCELL_E2B_MAX_SANDBOXES", 32, minimum=1),
            e2b_max_snapshots=read.integer("SANDCELL_E2B_MAX_SNAPSHOTS", 100, minimum=1),
            idempotency_ttl_s=read.number("SANDCELL_IDEMPOTENCY_TTL_S", 86_400.0, minimum=1),
            idempotency_claim_ttl_s=read.number(
                "SANDCELL_IDEMPOTENCY_CLAIM_TTL_S", 30.0, minimum=1
            ),
        )

    @property
    def public_host(self) -> str:
        """The host a link to this service names (a wildcard address means this host)."""
        return self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"  # noqa: S104


def _e2b_domain(value: str | None) -> str | None:
    if not value:
        return None
    domain = value.strip().lower().rstrip(".")
    if not re.fullmatch(r"[a-z0-9-]+(\.[a-z0-9-]+)+", domain):
        raise ConfigError(f"SANDCELL_E2B_DOMAIN: not a DNS domain: {value[:100]!r}")
    return domain


def _default_home() -> Path:
    return Path.home() / ".local" / "share" / "sandcell"


@dataclass(frozen=True, slots=True)
class OrchestratorSettings:
    """Everything the orchestrator is configured with. Build with ``from_env``."""

    home: Path = field(default_factory=_default_home)
    provider: ProviderSettings = field(default_factory=LocalSettings)
    registry_url: str | None = field(default=None, repr=False)
    snapshot_url: str | None = None
    s3: S3Settings | None = None
    session_mode: SessionMode = "affinity"
    production: bool = False
    budgets: Budgets = field(default_factory=Budgets)
    checkpoint_max_bytes: int = 1 << 30
    checkpoint_grace_s: float = 600.0
    """How long a superseded checkpoint object is kept before it is collected."""
    checkpoint_retry_s: float = 10.0
    """``SANDCELL_CHECKPOINT_RETRY_S``: how long a turn retries a failed checkpoint (0: once)."""
    idle_timeout_s: float = 1800.0
    sweep_interval_s: float = 60.0
    max_warm_sessions: int = 64
    """``SANDCELL_MAX_WARM_SESSIONS``: warm session sandboxes one tenant may hold on a
    worker; past it, the tenant's least recently used one is suspended."""
    log_level: LogLevel | None = None
    """``SANDCELL_LOG_LEVEL``: the process's logging level; None: the command's own
    (``info`` for ``sandcell serve``, ``warning`` for the others)."""
    serve: ServeSettings = field(default_factory=ServeSettings)
    apps: AppSettings = field(default_factory=lambda: _apps({}, ServeSettings()))
    """The app-instance API's settings (``sandcell serve``'s ``/v1/instances``)."""
    librechat: LibreChatSettings = field(default_factory=lambda: _librechat({}))
    """LibreChat's Code Interpreter API (``sandcell serve``'s ``/librechat/v1``)."""
    answer_caps: AnswerCaps = field(default_factory=lambda: _answer_caps({}))
    """``SANDCELL_ANSWER_*``: the ceiling of every ``RunnerClient`` the providers build,
    the most of each kind of answer read from any runner (``runner/answers.py``)."""

    @property
    def provider_name(self) -> ProviderName:
        """``SANDCELL_PROVIDER``: which backend ``provider`` configures."""
        return self.provider.kind

    @property
    def state_dir(self) -> Path:
        """Where the local provider keeps its runners' roots."""
        return self.home / "sandboxes"

    @property
    def registry_path(self) -> Path:
        """The embedded registry's SQLite file (unless ``SANDCELL_REGISTRY_URL`` names one)."""
        url = self.registry_url
        if url is not None and url.startswith("sqlite:///"):
            return Path(url.removeprefix("sqlite://"))
        return self.home / "registry.sqlite3"

    @property
    def distributed_registry(self) -> bool:
        """Whether the registry is shared beyond this machine (Redis): sandboxes then
        outlive this process; with an embedded one they go when it exits."""
        return self.registry_url is not None and not self.registry_url.startswith(
            ("sqlite:", "memory:")
        )

    @property
    def snapshot_dir(self) -> Path:
        return self.home / "snapshots"

    @property
    def inputs_dir(self) -> Path:
        return self.home / "inputs"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OrchestratorSettings:
        """Read and validate every ``SANDCELL_*`` variable; ``ConfigError`` names the culprit."""
        read = EnvReader(env)
        home_default = Path(env.get("HOME", str(Path.home()))) / ".local" / "share" / "sandcell"
        home = read.path("SANDCELL_HOME", home_default)
        provider_name = read.choice("SANDCELL_PROVIDER", _PROVIDERS, "local")
        mode = read.choice("SANDCELL_RUNTIME_SESSION_MODE", _MODES, "affinity")
        registry_url = read.text("SANDCELL_REGISTRY_URL")
        if registry_url is not None and not (
            registry_url.startswith(("redis://", "rediss://", "unix://", "sqlite:///"))
            or registry_url == "memory://"
        ):
            raise ConfigError(
                "SANDCELL_REGISTRY_URL must be a redis://, rediss://, unix://,"
                " sqlite:///absolute/path or memory:// URL"
            )
        snapshot_url = read.text("SANDCELL_SNAPSHOT_URL")
        if snapshot_url is not None and not snapshot_url.startswith(("s3://", "file://")):
            raise ConfigError("SANDCELL_SNAPSHOT_URL must be s3://bucket/prefix or file:///path")
        checkpoint_max_bytes = read.integer("SANDCELL_CHECKPOINT_MAX_BYTES", 1 << 30, minimum=1)
        serve = ServeSettings.from_env(env)
        return cls(
            home=home,
            provider=_provider(provider_name, env),
            registry_url=registry_url,
            snapshot_url=snapshot_url,
            s3=_s3(snapshot_url, env),
            session_mode=mode,
            production=read.production(),
            budgets=Budgets(
                launch_s=read.number("SANDCELL_LAUNCH_TIMEOUT_S", 30.0),
                health_s=read.number("SANDCELL_HEALTH_TIMEOUT_S", 15.0),
                execute_s=read.number("SANDCELL_EXECUTE_TIMEOUT_S", 300.0),
                checkpoint_s=read.number("SANDCELL_CHECKPOINT_TIMEOUT_S", 120.0),
                lock_ttl_s=read.number("SANDCELL_LOCK_TTL_S", 15.0, minimum=1),
            ),
            checkpoint_max_bytes=checkpoint_max_bytes,
            checkpoint_grace_s=read.number("SANDCELL_CHECKPOINT_GRACE_S", 600.0, minimum=0),
            checkpoint_retry_s=read.number("SANDCELL_CHECKPOINT_RETRY_S", 10.0, minimum=0),
            idle_timeout_s=read.number("SANDCELL_IDLE_TIMEOUT_S", 1800.0),
            sweep_interval_s=read.number("SANDCELL_SWEEP_INTERVAL_S", 60.0),
            max_warm_sessions=read.integer("SANDCELL_MAX_WARM_SESSIONS", 64, minimum=1),
            log_level=read.parse("SANDCELL_LOG_LEVEL", None, _log_level),
            serve=serve,
            apps=_apps(env, serve),
            librechat=_librechat(env),
            answer_caps=_answer_caps(env),
        )


def _log_level(raw: str) -> LogLevel:
    """A logging level's name, in either case."""
    for level in _LOG_LEVELS:
        if raw.lower() == level:
            return level
    raise ValueError(f"must be one of {', '.join(_LOG_LEVELS)}, got {raw[:40]!r}")


def _provider(name: ProviderName, env: Mapping[str, str]) -> ProviderSettings:
    # Only the chosen provider's settings module is imported.
    if name == "docker":
        from .providers.docker_settings import DockerSettings

        return DockerSettings.from_env(env)
    if name == "lambda-microvm":
        from .providers.lambda_settings import LambdaMicrovmSettings

        return LambdaMicrovmSettings.from_env(env)
    return LocalSettings.from_env(env)


def _s3(url: str | None, env: Mapping[str, str]) -> S3Settings | None:
    if url is None or not url.startswith("s3://"):
        return None
    from .snapshots.s3_settings import S3Settings

    return S3Settings.from_env(env, url)


def _apps(env: Mapping[str, str], serve: ServeSettings) -> AppSettings:
    from .apps.settings import AppSettings

    return AppSettings.from_env(env, default_public_url=f"http://{serve.public_host}:{serve.port}")


def _librechat(env: Mapping[str, str]) -> LibreChatSettings:
    from .serve.librechat.settings import LibreChatSettings

    return LibreChatSettings.from_env(env)


def _answer_caps(env: Mapping[str, str]) -> AnswerCaps:
    """The ceiling of runners' answers, each field from its ``CEILING_ENV`` variable.

    The defaults are the runner's own default maxima, deliberately not more. Caps follow
    what a runner states (``AnswerCaps.following``), so an honest runner is read by its
    own limits whatever the ceiling; the ceiling only decides what a runner configured
    above it gets, and what a compromised one does: tenant code that took over the runner
    in its container or VM states whatever limits it likes, so the ceiling *is* the memory
    one sandbox can make this process hold per answer in flight (at these defaults a run's
    answer up to ~1.1 GiB: JSON-escaped output of 64 MiB a stream plus 256 MiB of
    base64-encoded files). A runner's per-job defaults (``SANDCELL_RUNNER_STDOUT_BYTES``…)
    can already rise to these maxima with nothing set here; raising its maxima raises what
    this process must hold, which its operator decides here, once, by the variable the
    error names.
    """
    from .runner.answers import CEILING_ENV, DEFAULT_CAPS, AnswerCaps

    read = EnvReader(env)
    output = read.integer(
        CEILING_ENV["max_stdout_bytes"], DEFAULT_CAPS.max_stdout_bytes, minimum=1 << 10
    )
    return AnswerCaps(
        max_stdout_bytes=output,
        max_stderr_bytes=output,
        # What a runner that states no limits (before protocol 1.3) is assumed to default
        # to: its own default, unless the ceiling is lower.
        stdout_bytes=min(DEFAULT_CAPS.stdout_bytes, output),
        stderr_bytes=min(DEFAULT_CAPS.stderr_bytes, output),
        output_scan_bytes=read.integer(
            CEILING_ENV["output_scan_bytes"], DEFAULT_CAPS.output_scan_bytes
        ),
        max_output_files=read.integer(
            CEILING_ENV["max_output_files"], DEFAULT_CAPS.max_output_files
        ),
        max_body_bytes=read.integer(
            CEILING_ENV["max_body_bytes"], DEFAULT_CAPS.max_body_bytes, minimum=1 << 10
        ),
        max_timeout_ms=read.integer(
            CEILING_ENV["max_timeout_ms"], DEFAULT_CAPS.max_timeout_ms, minimum=1000
        ),
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
