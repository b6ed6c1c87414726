"""Typed settings of the ``local`` provider (the embedded default): how runners start.

Read once at start-up (by ``OrchestratorSettings.from_env``, through the shared
``EnvReader``); the provider takes the settings object. ``runner_env`` is what
every runner inherits (its limits and jail settings), captured here so no raw
environment travels further.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..env import RUNNER_UNPREFIXED, EnvReader

__all__ = ["LocalSettings", "default_runtime_dir"]

# The provider sets these per runner; the environment cannot.
_OWN_ENV = (
    "SANDCELL_RUNNER_TOKEN",
    "SANDCELL_RUNNER_TOKEN_FILE",
    "SANDCELL_RUNNER_PORT",
    "SANDCELL_RUNNER_HOST",
)
_INHERITED = (
    "SANDCELL_NSJAIL",
    "SANDCELL_ENV",
    "SANDCELL_FILE_SERVER_URL",
    "PATH",
    *RUNNER_UNPREFIXED,
)


def default_runtime_dir() -> Path:
    """Runner roots must be traversable by job UIDs: not under a 0700 home."""
    if os.geteuid() == 0:
        return Path("/var/lib/sandcell/sandboxes")
    return Path(f"/tmp/sandcell-{os.getuid()}/sandboxes")  # noqa: S108


@dataclass(frozen=True, slots=True)
class LocalSettings:
    """How local runners are started."""

    kind: Literal["local"] = "local"
    runtime_dir: Path = field(default_factory=default_runtime_dir)
    pool_size: int = 0
    ready_timeout_s: float = 30.0
    runner_env: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold secrets
    python: str = sys.executable
    detached_idle_s: int | None = None
    """None: runners die with the process that started them. A number: they outlive
    it (another process reaches them through ``connect``) and exit by themselves
    after that many seconds without a request. ``sandcell run`` keeps its session's
    code contexts warm between calls this way."""
    zygote: bool = True
    """Fork runners from a pre-imported zygote once it is up (``local_zygote.py``);
    False: every runner is a fresh ``python -m sandcell_runner``. Never for detached
    runners."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LocalSettings:
        """Read ``SANDCELL_LOCAL_*``; ``ConfigError`` names the variable."""
        read = EnvReader(env)
        return cls(
            runtime_dir=read.path("SANDCELL_LOCAL_RUNTIME_DIR", default_runtime_dir()),
            pool_size=read.integer("SANDCELL_LOCAL_POOL_SIZE", 0),
            zygote=read.choice("SANDCELL_LOCAL_ZYGOTE", ("1", "0"), "1") == "1",
            # Runner limits and jail settings pass through unchanged.
            runner_env=read.passthrough(("SANDCELL_RUNNER_",), names=_INHERITED, exclude=_OWN_ENV),
        )
