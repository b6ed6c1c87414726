"""The runner's egress settings, read once with the rest of its configuration."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Network
from pathlib import Path

from sandcell_protocol import EgressPolicy, ProtocolError, decode
from sandcell_protocol.addresses import parse_networks

from ..errors import ConfigError
from .plumbing import parse_subnet
from .relay import BULK_BYTES

_DEFAULT_SUBNET = "10.213.0.0/16"


@dataclass(frozen=True, slots=True)
class EgressSettings:
    """How the runner enforces a sandbox's egress policy (see ``egress/manager.py``)."""

    enabled: bool = True
    """``SANDCELL_RUNNER_EGRESS=0`` keeps every job on ``lo`` only (no gateway)."""
    policy: EgressPolicy = field(default_factory=EgressPolicy)
    """The policy at start-up (``SANDCELL_RUNNER_EGRESS_POLICY``, JSON); a route replaces it."""
    subnet: IPv4Network = field(default_factory=lambda: parse_subnet(_DEFAULT_SUBNET))
    """Where the runner numbers its /30 links (``SANDCELL_RUNNER_EGRESS_SUBNET``)."""
    allow_nets: str = ""
    """Always-refused networks the operator opens (``SANDCELL_RUNNER_EGRESS_ALLOW_NETS``)."""
    upstream: str = "127.0.0.53"
    upstream_port: int = 53
    """The resolver the gateway asks (``SANDCELL_RUNNER_EGRESS_DNS``: ``IP`` or ``IP:port``;
    default: the first ``nameserver`` of the runner's ``/etc/resolv.conf``)."""
    uid: int = 65534
    """The gateway process's UID and GID (``SANDCELL_RUNNER_EGRESS_UID``)."""
    bulk_bytes: int = BULK_BYTES
    """What a connection moves on the gateway's event loop before splice threads take it
    (0: threads from the first byte). Not an operator setting: the benchmark's A/B."""

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], *, resolv_conf: Path = Path("/etc/resolv.conf")
    ) -> EgressSettings:
        """Read the ``SANDCELL_RUNNER_EGRESS*`` variables; ``ConfigError`` names the bad one."""
        raw_flag = env.get("SANDCELL_RUNNER_EGRESS", "1").strip().lower()
        if raw_flag not in ("0", "1", "true", "false", "yes", "no", "on", "off", ""):
            raise ConfigError(f"SANDCELL_RUNNER_EGRESS: must be 0 or 1, got {raw_flag!r}")
        enabled = raw_flag in ("1", "true", "yes", "on", "")
        policy = EgressPolicy()
        if raw := env.get("SANDCELL_RUNNER_EGRESS_POLICY", "").strip():
            try:
                policy = decode(raw, EgressPolicy)
            except ProtocolError as exc:
                raise ConfigError(f"SANDCELL_RUNNER_EGRESS_POLICY: {exc}") from None
        try:
            subnet = parse_subnet(env.get("SANDCELL_RUNNER_EGRESS_SUBNET") or _DEFAULT_SUBNET)
        except ValueError as exc:
            raise ConfigError(f"SANDCELL_RUNNER_EGRESS_SUBNET: {exc}") from None
        allow_nets = env.get("SANDCELL_RUNNER_EGRESS_ALLOW_NETS", "").strip()
        try:
            parse_networks(allow_nets)
        except ValueError as exc:
            raise ConfigError(f"SANDCELL_RUNNER_EGRESS_ALLOW_NETS: {exc}") from None
        dns_raw = env.get("SANDCELL_RUNNER_EGRESS_DNS", "").strip() or _first_nameserver(
            resolv_conf
        )
        try:
            upstream, upstream_port = _host_port(dns_raw)
        except ValueError as exc:
            raise ConfigError(f"SANDCELL_RUNNER_EGRESS_DNS: {exc}") from None
        uid_raw = env.get("SANDCELL_RUNNER_EGRESS_UID", "65534").strip() or "65534"
        if not uid_raw.isdigit() or int(uid_raw) == 0:
            raise ConfigError("SANDCELL_RUNNER_EGRESS_UID: must be a non-zero UID")
        return cls(
            enabled=enabled,
            policy=policy,
            subnet=subnet,
            allow_nets=allow_nets,
            upstream=upstream,
            upstream_port=upstream_port,
            uid=int(uid_raw),
        )


def _first_nameserver(resolv_conf: Path) -> str:
    try:
        for line in resolv_conf.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                return parts[1]
    except OSError:
        pass
    return "127.0.0.53"


def _host_port(text: str) -> tuple[str, int]:
    host, port = text, 53
    if text.count(":") == 1:
        host, port_text = text.split(":")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"bad port in {text!r}")
        port = int(port_text)
    elif text.startswith("["):
        host, _, port_text = text[1:].partition("]:")
        port = int(port_text) if port_text.isdigit() else 53
    try:
        return str(ipaddress.ip_address(host.strip("[]"))), port
    except ValueError:
        raise ValueError(f"must be an IP address (optionally :port), got {text!r}") from None


__all__ = ["EgressSettings"]
