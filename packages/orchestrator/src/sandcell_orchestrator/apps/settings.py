"""Configuration of the app-instance API, read at start-up into ``OrchestratorSettings.apps``.

=============================== ======================================= =================
variable                        meaning                                 default
=============================== ======================================= =================
SANDCELL_TEMPLATES              ``name=source,...``; a source is a      the shipped
                                directory or ``git+<url>[#ref]``        ``templates/*``
SANDCELL_APP_HEALTH_INTERVAL_S  seconds between health checks           30
SANDCELL_APP_IDLE_TIMEOUT_S     an instance idle this long is shut down 1800
SANDCELL_APP_ERROR_POLL_S       how often new runtime errors are sought 2
SANDCELL_APP_WEBHOOK_SECRET     HMAC-SHA256 key signing webhook bodies  none (no webhooks)
SANDCELL_APP_WEBHOOK_ALLOW_NETS comma-separated CIDRs webhooks may      none (public
                                reach although not public, e.g.         addresses only)
                                ``127.0.0.1/32,10.0.0.0/8``
SANDCELL_APP_GIT_AUTHOR         ``Name <email>`` of workspace commits   sandcell
SANDCELL_APP_DENIED_COMMANDS    extra ``name=regex`` rules, one a line  none
SANDCELL_PUBLIC_URL             base URL of preview links               http://host:port
=============================== ======================================= =================

Webhook URLs are the API caller's, so by default a webhook may only go to a
globally routable address: loopback, link-local (cloud metadata), private,
CGNAT and other special ranges are refused, however the URL spells them and
whatever its name resolves to (``webhook_targets``). List a network in
``SANDCELL_APP_WEBHOOK_ALLOW_NETS`` only when its receivers are meant to be
reachable by every tenant of the API.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from .webhook_targets import IPNetwork

__all__ = ["SHIPPED_TEMPLATES_DIR", "AppSettings", "GitAuthor"]

SHIPPED_TEMPLATES_DIR = Path(__file__).resolve().parents[5] / "templates"
"""``templates/`` of the source tree (the package is installed editable from it)."""

_TEMPLATE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_AUTHOR_RE = re.compile(r"([^<>\x00-\x1f]{1,100}?)\s*<([^<>\s\x00-\x1f]{1,200})>")


@dataclass(frozen=True, slots=True)
class GitAuthor:
    """Who the workspace's commits are by."""

    name: str = "sandcell"
    email: str = "sandcell@localhost"


@dataclass(frozen=True, slots=True)
class AppSettings:
    """Everything the app-instance API is configured with. Build with ``from_env``."""

    templates: Mapping[str, str] = field(default_factory=dict)
    """Template name -> source: an absolute directory, or ``git+<url>[#ref]``."""
    public_url: str = "http://127.0.0.1:8000"
    health_interval_s: float = 30.0
    idle_timeout_s: float = 1800.0
    error_poll_s: float = 2.0
    webhook_secret: str | None = field(default=None, repr=False)
    webhook_allow_nets: tuple[IPNetwork, ...] = ()
    """Networks webhooks may reach although not public (``WebhookSender(allow_nets=...)``)."""
    git_author: GitAuthor = field(default_factory=GitAuthor)
    denied_commands: tuple[tuple[str, str], ...] = ()
    """Extra policy rules as ``(name, regex)``, on top of the built-in ones."""

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], *, default_public_url: str = "http://127.0.0.1:8000"
    ) -> AppSettings:
        """Read the variables above; ``ConfigError`` names the variable at fault."""
        secret = env.get("SANDCELL_APP_WEBHOOK_SECRET") or None
        if secret is not None and len(secret) < 16:
            raise ConfigError("SANDCELL_APP_WEBHOOK_SECRET must be at least 16 characters")
        return cls(
            templates=_templates(env.get("SANDCELL_TEMPLATES", "")),
            public_url=_public_url(env.get("SANDCELL_PUBLIC_URL") or default_public_url),
            health_interval_s=_seconds(env, "SANDCELL_APP_HEALTH_INTERVAL_S", 30.0),
            idle_timeout_s=_seconds(env, "SANDCELL_APP_IDLE_TIMEOUT_S", 1800.0),
            error_poll_s=_seconds(env, "SANDCELL_APP_ERROR_POLL_S", 2.0),
            webhook_secret=secret,
            webhook_allow_nets=_networks(env, "SANDCELL_APP_WEBHOOK_ALLOW_NETS"),
            git_author=_author(env.get("SANDCELL_APP_GIT_AUTHOR", "")),
            denied_commands=_rules(env.get("SANDCELL_APP_DENIED_COMMANDS", "")),
        )


def _shipped() -> dict[str, str]:
    if not SHIPPED_TEMPLATES_DIR.is_dir():
        return {}
    return {
        child.name: str(child)
        for child in sorted(SHIPPED_TEMPLATES_DIR.iterdir())
        if (child / "sandcell-template.toml").is_file()
    }


def _templates(raw: str) -> dict[str, str]:
    if not raw.strip():
        return _shipped()
    found: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, source = item.partition("=")
        name, source = name.strip(), source.strip()
        if not sep or not _TEMPLATE_NAME_RE.fullmatch(name) or not source:
            raise ConfigError(
                "SANDCELL_TEMPLATES must be name=source pairs (names: lower-case letters,"
                " digits, '.', '_', '-')"
            )
        if not source.startswith("git+") and not Path(source).is_absolute():
            raise ConfigError(f"SANDCELL_TEMPLATES: {name}: a directory must be an absolute path")
        found[name] = source
    return found


def _public_url(raw: str) -> str:
    url = raw.strip().rstrip("/")
    if not re.fullmatch(r"https?://[^\s/?#@]+(/[^\s?#]*)?", url):
        raise ConfigError("SANDCELL_PUBLIC_URL must be an http(s) URL without query or user info")
    return url


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected a number of seconds, got {raw[:40]!r}") from None
    if not value > 0:
        raise ConfigError(f"{name}: must be positive")
    return value


def _networks(env: Mapping[str, str], name: str) -> tuple[IPNetwork, ...]:
    found: list[IPNetwork] = []
    for item in filter(None, (part.strip() for part in env.get(name, "").split(","))):
        try:
            # strict: "10.0.0.1/8" is a typo for a host or for a network; say so, don't guess.
            found.append(ipaddress.ip_network(item, strict=True))
        except ValueError as exc:
            raise ConfigError(f"{name}: {item[:60]!r} is not a CIDR network: {exc}") from None
    return tuple(found)


def _author(raw: str) -> GitAuthor:
    if not raw.strip():
        return GitAuthor()
    match = _AUTHOR_RE.fullmatch(raw.strip())
    if match is None:
        raise ConfigError("SANDCELL_APP_GIT_AUTHOR must look like 'Name <email>'")
    return GitAuthor(name=match.group(1).strip(), email=match.group(2))


def _rules(raw: str) -> tuple[tuple[str, str], ...]:
    rules: list[tuple[str, str]] = []
    for line in filter(None, (part.strip() for part in raw.splitlines())):
        name, sep, pattern = line.partition("=")
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,63}", name.strip()):
            raise ConfigError(
                "SANDCELL_APP_DENIED_COMMANDS: each line must be name=regex"
                " (names: lower-case letters, digits, '-')"
            )
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"SANDCELL_APP_DENIED_COMMANDS: {name}: bad regex: {exc}") from None
        rules.append((name.strip(), pattern))
    return tuple(rules)
