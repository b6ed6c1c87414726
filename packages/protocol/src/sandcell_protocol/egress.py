"""A sandbox's network egress policy: the wire shape, its rules, and the one decision.

A policy is one of three modes:

* ``deny_all`` (the default): nothing leaves the sandbox;
* ``allow``: only destinations an ``allow`` rule names;
* ``allow_all``: anything but the always-refused destinations (``addresses``).

``deny`` rules take precedence over every mode. A rule is a string:

============================  ==============================================
``example.com``               exactly that name
``*.example.com``             every name under it (not ``example.com`` itself)
``10.1.0.0/16``, ``8.8.8.8``  addresses in that network (IP literals, raw TCP,
                              or a name whose every address lies in it)
``[2001:db8::/32]``           an IPv6 network (brackets needed with a port)
any of them ``:443``          only that port; ``:8000-8100`` a range
============================  ==============================================

Whatever the policy says, the always-refused destinations stay refused: the
runner applies ``AddressRules`` after ``EgressPolicy.decide``.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from .addresses import IPAddress, IPNetwork
from .base import Message, NonNegativeInt
from .digits import is_ascii_digits

__all__ = [
    "EGRESS_MESSAGES",
    "EgressEvent",
    "EgressMechanism",
    "EgressMode",
    "EgressPolicy",
    "EgressReason",
    "EgressRule",
    "EgressStatus",
    "EgressVerdict",
    "parse_rule",
]

EgressMode = Literal["deny_all", "allow", "allow_all"]
EgressMechanism = Literal["nftables", "none"]
"""How a runner enforces egress policy: ``nftables`` (its gateway), ``none`` (only ``lo``)."""
_MAX_RULES = 256
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_PORTS = re.compile(r"^([0-9]{1,5})(?:-([0-9]{1,5}))?$")


class EgressReason(enum.StrEnum):
    """Why a connection was allowed or refused (carried in ``EgressEvent.reason``)."""

    ALLOWED = "allowed"
    DENY_ALL = "deny_all"
    """The policy's mode is ``deny_all``."""
    NOT_ALLOWED = "not_allowed"
    """Mode ``allow`` and no allow rule names the destination."""
    DENIED_BY_RULE = "denied_by_rule"
    REFUSED_ADDRESS = "refused_address"
    """An always-refused address (loopback, private, metadata, the host's own, …)."""
    REFUSED_NAME = "refused_name"
    """A name that always means this machine or a metadata service."""
    NO_ADDRESS = "no_address"
    """The name did not resolve (or only to refused addresses)."""
    UNKNOWN_DESTINATION = "unknown_destination"
    """Transparent TCP whose destination names nothing the policy allows."""


@dataclass(frozen=True, slots=True)
class EgressRule:
    """One parsed rule: a name, a name suffix or a network, and optional ports."""

    text: str
    """The rule as written, normalized (lower case, no trailing dot)."""
    domain: str | None = None
    wildcard: bool = False
    """``domain`` is a suffix: ``*.example.com`` matches names under it."""
    network: IPNetwork | None = None
    ports: tuple[tuple[int, int], ...] = ()
    """Inclusive port ranges; empty means every port."""

    def matches_port(self, port: int) -> bool:
        return not self.ports or any(lo <= port <= hi for lo, hi in self.ports)

    def matches_name(self, name: str) -> bool:
        if self.domain is None:
            return False
        if self.wildcard:
            return name.endswith("." + self.domain)
        return name == self.domain

    def matches_address(self, address: IPAddress) -> bool:
        return self.network is not None and address in self.network


def _normal_name(name: str) -> str:
    return name.rstrip(".").lower()


def _parse_domain(text: str) -> str:
    if not text.isascii():
        raise ValueError(f"egress rule {text!r}: write international names in punycode")
    name = _normal_name(text)
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(f"egress rule {text!r} is not a domain name, network or address")
    return name


def _parse_ports(text: str, rule: str) -> tuple[tuple[int, int], ...]:
    match = _PORTS.match(text)
    if match is None:
        raise ValueError(f"egress rule {rule!r}: port must be N or N-M")
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) else lo
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"egress rule {rule!r}: ports are 1-65535, low to high")
    return ((lo, hi),)


@functools.lru_cache(maxsize=4096)
def parse_rule(text: str) -> EgressRule:
    """Parse one rule (see the module docstring); ``ValueError`` says what is wrong."""
    raw = text.strip()
    if not raw or len(raw) > 300:
        raise ValueError("egress rule must be 1-300 characters")
    host, ports = raw, ""
    if raw.startswith("["):
        close = raw.find("]")
        rest = raw[close + 1 :] if close >= 0 else "?"
        if rest and not rest.startswith(":"):
            raise ValueError(f"egress rule {raw!r}: unbalanced brackets")
        host, ports = raw[1:close], rest[1:]
        if rest == ":":
            raise ValueError(f"egress rule {raw!r}: port must be N or N-M")
    elif raw.count(":") == 1:
        host, ports = raw.split(":")
        if not ports:
            raise ValueError(f"egress rule {raw!r}: port must be N or N-M")
    parsed_ports = _parse_ports(ports, raw) if ports else ()
    suffix = ":" + ports if ports else ""
    if "/" in host or ":" in host or _looks_numeric(host):
        try:
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            raise ValueError(f"egress rule {raw!r} is not a network or address") from None
        shown = f"[{network}]" if network.version == 6 and suffix else str(network)
        return EgressRule(text=shown + suffix, network=network, ports=parsed_ports)
    if host == "*":
        raise ValueError("egress rule '*' is not a rule: use mode allow_all")
    if host.startswith("*."):
        domain = _parse_domain(host[2:])
        return EgressRule(
            text=f"*.{domain}{suffix}", domain=domain, wildcard=True, ports=parsed_ports
        )
    if "*" in host:
        raise ValueError(
            f"egress rule {raw!r}: '*' only as the whole first label ('*.example.com')"
        )
    domain = _parse_domain(host)
    return EgressRule(text=domain + suffix, domain=domain, ports=parsed_ports)


def _looks_numeric(host: str) -> bool:
    """A dotted run of digits is an address (even a malformed one), never a name."""
    return bool(host) and all(is_ascii_digits(part) for part in host.split("."))


@dataclass(frozen=True, slots=True)
class EgressVerdict:
    """The decision about one destination."""

    allowed: bool
    reason: EgressReason


_ALLOWED = EgressVerdict(True, EgressReason.ALLOWED)


class EgressPolicy(Message, frozen=True):
    """Where a sandbox's connections may go; see the module docstring."""

    mode: EgressMode = "deny_all"
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.allow and self.mode != "allow":
            raise ValueError("egress allow rules need mode 'allow'")
        if len(self.allow) + len(self.deny) > _MAX_RULES:
            raise ValueError(f"egress policy: at most {_MAX_RULES} rules")
        for rule in (*self.allow, *self.deny):
            parse_rule(rule)

    @property
    def allow_rules(self) -> tuple[EgressRule, ...]:
        return tuple(parse_rule(rule) for rule in self.allow)

    @property
    def deny_rules(self) -> tuple[EgressRule, ...]:
        return tuple(parse_rule(rule) for rule in self.deny)

    def decide(
        self, *, name: str | None, addresses: Sequence[IPAddress] = (), port: int
    ) -> EgressVerdict:
        """May a connection to ``name`` (or, without one, to ``addresses``) on ``port`` go?

        ``name`` is what the client asked for (a ``Host``, an SNI, a ``CONNECT``
        target); ``addresses`` what it resolved to, or the literal address. A deny
        rule matching either refuses; an allow rule must match the name, or (a CIDR
        rule) every address.
        """
        normal = _normal_name(name) if name is not None else None
        for rule in self.deny_rules:
            if rule.matches_port(port) and (
                (normal is not None and rule.matches_name(normal))
                or any(rule.matches_address(a) for a in addresses)
            ):
                return EgressVerdict(False, EgressReason.DENIED_BY_RULE)
        if self.mode == "allow_all":
            return _ALLOWED
        if self.mode == "deny_all":
            return EgressVerdict(False, EgressReason.DENY_ALL)
        rules = [rule for rule in self.allow_rules if rule.matches_port(port)]
        if normal is not None and any(rule.matches_name(normal) for rule in rules):
            return _ALLOWED
        if addresses and all(any(r.matches_address(a) for r in rules) for a in addresses):
            return _ALLOWED
        return EgressVerdict(False, EgressReason.NOT_ALLOWED)

    def may_resolve(self, name: str) -> bool:
        """Could a connection to ``name`` be allowed on some port (without its addresses)?

        What the runner's DNS resolver asks before it answers a name.
        """
        normal = _normal_name(name)
        if any(r.matches_name(normal) and not r.ports for r in self.deny_rules):
            return False
        if self.mode != "allow":
            return self.mode == "allow_all"
        return any(rule.matches_name(normal) for rule in self.allow_rules)

    @property
    def has_networks(self) -> bool:
        """True if an allow rule names a network (names may then resolve by address)."""
        return any(rule.network is not None for rule in self.allow_rules)


EgressVerdictName = Literal["allowed", "refused"]
EgressTransport = Literal["http", "connect", "tls", "tcp", "dns"]


class EgressEvent(Message, frozen=True):
    """One connection the runner's egress gateway allowed or refused."""

    verdict: EgressVerdictName
    reason: EgressReason
    transport: EgressTransport
    name: str | None = None
    address: str | None = None
    port: NonNegativeInt = 0
    at_ms: NonNegativeInt = 0
    """Wall-clock time of the decision (Unix epoch milliseconds)."""


class EgressStatus(Message, frozen=True):
    """``GET /v1/egress`` (and the answer to ``PUT``): policy, mechanism, counters."""

    mechanism: EgressMechanism
    policy: EgressPolicy
    allowed_total: NonNegativeInt = 0
    refused_total: NonNegativeInt = 0
    recent_refused: list[EgressEvent] = msgspec.field(default_factory=list)
    """The latest refusals, oldest first (a bounded window)."""


EGRESS_MESSAGES: tuple[type[Message], ...] = (EgressPolicy, EgressEvent, EgressStatus)
