"""``EnvReader``: the one way a setting is read from the environment.

Every typed settings object (``OrchestratorSettings`` and the provider, S3, app
and serve settings under it) parses its variables through this reader, at
start-up only, so every bad value is a ``ConfigError`` that names its variable
and echoes at most 40 characters of what it got. A value that is only blanks
counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from .errors import ConfigError

__all__ = ["RUNNER_UNPREFIXED", "EnvReader"]

T = TypeVar("T")
_ECHO_CHARS = 40

RUNNER_UNPREFIXED = (
    "SANDCELL_CHECKPOINT_MAX_BYTES",
    "SANDCELL_CHECKPOINT_MAX_MEMBERS",
    "SANDCELL_INPUT_MAX_OBJECT_BYTES",
)
"""Runner settings outside ``SANDCELL_RUNNER_*`` that a launched runner inherits with
them. Their names predate the prefix and are documented, so they stay; the checkpoint
caps are also the orchestrator's own (``SANDCELL_CHECKPOINT_MAX_BYTES``), and a runner
that did not see them would export and restore under its defaults instead."""


class EnvReader:
    """Typed reads of one environment mapping (``os.environ`` at the edge, a dict in tests)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    def __repr__(self) -> str:
        # The mapping holds secrets: show nothing of it.
        return f"EnvReader(<{len(self._env)} variables>)"

    def text(self, name: str) -> str | None:
        """The stripped value, or ``None`` when unset or blank."""
        value = self._env.get(name, "").strip()
        return value or None

    def raw(self, name: str) -> str | None:
        """The value exactly as set (secrets, multi-line rules), or ``None`` when unset/empty."""
        return self._env.get(name) or None

    def parse(self, name: str, default: T, parse: Callable[[str], T]) -> T:
        """``parse(value)``, or ``default`` when unset; a ``ValueError`` names ``name``."""
        raw = self.text(name)
        if raw is None:
            return default
        try:
            return parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    def number(self, name: str, default: float, *, minimum: float = 0.001) -> float:
        """A float ``>= minimum``."""

        def parse(raw: str) -> float:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"must be a number, got {_echo(raw)}") from None
            if not value >= minimum:
                raise ValueError(f"must be >= {minimum:g}, got {_echo(raw)}")
            return value

        return self.parse(name, default, parse)

    def integer(
        self, name: str, default: int, *, minimum: int = 0, maximum: int | None = None
    ) -> int:
        """A whole number in ``[minimum, maximum]``."""

        def parse(raw: str) -> int:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"must be an integer, got {_echo(raw)}") from None
            if value < minimum or (maximum is not None and value > maximum):
                upper = "" if maximum is None else f" and <= {maximum}"
                raise ValueError(f"must be >= {minimum}{upper}, got {_echo(raw)}")
            return value

        return self.parse(name, default, parse)

    def choice(self, name: str, options: tuple[T, ...], default: T) -> T:
        """One of ``options`` (compared as text)."""

        def parse(raw: str) -> T:
            for option in options:
                if raw == option:
                    return option
            listed = ", ".join(map(str, options))
            raise ValueError(f"must be one of {listed}, got {_echo(raw)}")

        return self.parse(name, default, parse)

    def flag(self, name: str) -> bool:
        """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (unset: false)."""

        def parse(raw: str) -> bool:
            lowered = raw.lower()
            if lowered in ("0", "false", "no", "off"):
                return False
            if lowered in ("1", "true", "yes", "on"):
                return True
            raise ValueError(f"must be 0 or 1, got {_echo(raw)}")

        return self.parse(name, False, parse)

    def path(self, name: str, default: Path) -> Path:
        """An absolute path (``~`` expanded)."""

        def parse(raw: str) -> Path:
            path = Path(os.path.expanduser(raw))
            if not path.is_absolute():
                raise ValueError(f"must be an absolute path, got {_echo(raw)}")
            return path

        return self.parse(name, default, parse)

    def csv(self, name: str) -> tuple[str, ...]:
        """Comma-separated items, blanks dropped."""
        return tuple(part.strip() for part in self._env.get(name, "").split(",") if part.strip())

    def production(self) -> bool:
        """Whether ``SANDCELL_ENV=production`` (the production guards apply)."""
        return (self.text("SANDCELL_ENV") or "").lower() == "production"

    def passthrough(
        self, prefixes: tuple[str, ...], *, names: Iterable[str] = (), exclude: Iterable[str] = ()
    ) -> dict[str, str]:
        """The variables a launched runner inherits: those under ``prefixes`` and ``names``."""
        excluded = set(exclude)
        wanted = set(names)
        return {
            key: value
            for key, value in self._env.items()
            if (key.startswith(prefixes) or key in wanted) and key not in excluded
        }


def _echo(raw: str) -> str:
    return repr(raw[:_ECHO_CHARS])
