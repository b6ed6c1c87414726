"""The gateway's decisions: the policy, the always-refused addresses, and its own lookups.

Every way out of a sandbox (a DNS answer, a proxy request, a transparent
connection) asks one ``Decider``, which:

* refuses the names and addresses ``sandcell_protocol.addresses`` always refuses,
  and any address of this host itself (asked of the kernel: an address a socket
  can bind to is local), before the policy is consulted;
* asks ``EgressPolicy.decide`` about the rest;
* resolves names itself (``Upstream``), drops refused answers, and returns the
  addresses to connect to, so the client's own lookup never picks the socket's
  destination (no DNS rebinding);
* records every decision as an ``EgressEvent`` through ``emit``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address

import dns.asyncresolver
import dns.exception
import dns.resolver

from sandcell_protocol.addresses import AddressRules, IPAddress, literal_address
from sandcell_protocol.egress import (
    EgressEvent,
    EgressPolicy,
    EgressReason,
    EgressTransport,
)

_MAX_ANSWERS = 4096
_MEMORY_S = 300.0
"""How long an address handed out by the DNS resolver stays tied to its name."""


def has_ipv6_route() -> bool:
    """True if this host could send to a global IPv6 address (no packet is sent)."""
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("2001:db8::1", 53))
        except OSError:
            return False
    return True


def is_local_address(address: IPAddress) -> bool:
    """True if ``address`` belongs to this host (a socket can bind to it)."""
    family = socket.AF_INET if isinstance(address, IPv4Address) else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


class Upstream:
    """The resolver the gateway asks (never the sandbox's own answers)."""

    def __init__(
        self,
        nameserver: str,
        port: int,
        *,
        lifetime_s: float = 5.0,
        ipv6: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ipv6 = ipv6
        """False: AAAA is never asked (this host cannot reach IPv6 anyway)."""
        self._resolver = dns.asyncresolver.Resolver(configure=False)
        self._resolver.nameservers = [nameserver]
        self._resolver.port = port
        self._resolver.lifetime = lifetime_s
        self._resolver.cache = dns.resolver.Cache()
        self._clock = clock
        self._answers: dict[tuple[str, str], tuple[float, list[IPAddress]]] = {}
        """Addresses by (name, type) until their TTL ends, an empty list for an answer
        without any (NODATA). dnspython's cache keeps them too, but reaching it costs a
        query's parsing and set-up (and a task each for A and AAAA) on every connection:
        this is a dictionary lookup. NXDOMAIN stays with dnspython's cache."""

    def _cached(self, name: str, rdtype: str) -> list[IPAddress] | None:
        entry = self._answers.get((name, rdtype))
        if entry is None or entry[0] <= self._clock():
            return None
        return entry[1]

    async def _query(self, name: str, rdtype: str) -> list[IPAddress]:
        cached = self._cached(name, rdtype)
        if cached is not None:
            return cached
        try:
            answer = await self._resolver.resolve(
                name, rdtype, search=False, raise_on_no_answer=False
            )
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer, dns.resolver.NoNameservers):
            return []
        except (dns.exception.Timeout, dns.exception.DNSException):
            return []
        found: list[IPAddress] = [ipaddress.ip_address(rr.address) for rr in answer.rrset or ()]
        if len(self._answers) >= _MAX_ANSWERS:
            now = self._clock()
            self._answers = {k: v for k, v in self._answers.items() if v[0] > now}
            if len(self._answers) >= _MAX_ANSWERS:
                self._answers.clear()
        ttl_s = max(0.0, answer.expiration - time.time())
        self._answers[(name, rdtype)] = (self._clock() + ttl_s, found)
        return found

    async def resolve(self, name: str, *, ipv6: bool = True) -> list[IPAddress]:
        """Every A (and AAAA) address of ``name``; empty when it does not resolve."""
        if not (ipv6 and self._ipv6):
            return await self._query(name, "A")
        v4, v6 = self._cached(name, "A"), self._cached(name, "AAAA")
        if v4 is not None and v6 is not None:
            return [*v4, *v6]
        found_v4, found_v6 = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        return [*found_v4, *found_v6]


@dataclass(frozen=True, slots=True)
class Decision:
    """A verdict, and where to connect when it allows."""

    allowed: bool
    reason: EgressReason
    addresses: list[IPAddress] = field(default_factory=list)


@dataclass(slots=True)
class Decider:
    """See the module docstring. ``policy`` is replaced whole when the runner says so."""

    rules: AddressRules
    upstream: Upstream
    emit: Callable[[EgressEvent], None]
    policy: EgressPolicy = field(default_factory=EgressPolicy)
    is_local: Callable[[IPAddress], bool] = is_local_address
    clock: Callable[[], float] = time.monotonic
    wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)
    _handed_out: dict[IPAddress, tuple[str, float]] = field(default_factory=dict)

    def address_ok(self, address: IPAddress) -> bool:
        """Not always refused, and not this host's own."""
        return self.rules.allows(address) and not self.is_local(address)

    def record(
        self,
        decision: Decision,
        *,
        transport: EgressTransport,
        name: str | None,
        address: IPAddress | None,
        port: int,
    ) -> Decision:
        self.emit(
            EgressEvent(
                verdict="allowed" if decision.allowed else "refused",
                reason=decision.reason,
                transport=transport,
                name=name[:253] if name else None,
                address=str(address) if address is not None else None,
                port=port,
                at_ms=self.wall_ms(),
            )
        )
        return decision

    async def by_host(self, host: str, port: int, *, transport: EgressTransport) -> Decision:
        """A connection to ``host`` (a name or an address literal) on ``port``."""
        literal = literal_address(host)
        if literal is not None:
            return self.by_address(literal, port, transport=transport)
        name = host.rstrip(".").lower()
        refused = self._refuse_name(name, port)
        if refused is not None:
            return self.record(refused, transport=transport, name=name, address=None, port=port)
        found = await self.upstream.resolve(name)
        vetted = self.rules.vetted(found)
        vetted = [a for a in vetted if not self.is_local(a)]
        if not vetted:
            reason = EgressReason.REFUSED_ADDRESS if found else EgressReason.NO_ADDRESS
            first = found[0] if found else None
            return self.record(
                Decision(False, reason), transport=transport, name=name, address=first, port=port
            )
        verdict = self.policy.decide(name=name, addresses=vetted, port=port)
        decision = Decision(verdict.allowed, verdict.reason, vetted if verdict.allowed else [])
        return self.record(decision, transport=transport, name=name, address=vetted[0], port=port)

    def _refuse_name(self, name: str, port: int) -> Decision | None:
        if not self.rules.allows_name(name):
            return Decision(False, EgressReason.REFUSED_NAME)
        verdict = self.policy.decide(name=name, port=port)
        if not verdict.allowed and not self.policy.has_networks:
            # Refused by name alone: answer at once, without a lookup.
            return Decision(False, verdict.reason)
        return None

    def by_address(
        self,
        address: IPAddress,
        port: int,
        *,
        transport: EgressTransport,
        name: str | None = None,
    ) -> Decision:
        """A connection to a literal ``address`` (or a transparent one) on ``port``."""
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        address = mapped or address
        if not self.address_ok(address):
            decision = Decision(False, EgressReason.REFUSED_ADDRESS)
        else:
            verdict = self.policy.decide(name=name, addresses=[address], port=port)
            decision = Decision(
                verdict.allowed, verdict.reason, [address] if verdict.allowed else []
            )
        return self.record(decision, transport=transport, name=name, address=address, port=port)

    # -- what the DNS resolver answers, remembered for transparent connections ----

    async def answer_a(self, name: str) -> tuple[EgressReason, list[IPAddress]]:
        """The A records the sandbox gets for ``name`` (refused: a reason, no addresses)."""
        name = name.rstrip(".").lower()
        if not self.rules.allows_name(name):
            return self._dns_refused(name, EgressReason.REFUSED_NAME)
        by_name = self.policy.may_resolve(name)
        if not by_name and not self.policy.has_networks:
            reason = self.policy.decide(name=name, port=0).reason
            return self._dns_refused(name, reason)
        found = await self.upstream.resolve(name, ipv6=False)
        vetted = [a for a in self.rules.vetted(found) if not self.is_local(a)]
        if not by_name:
            # Only a network rule could allow it: every answer must lie in one.
            nets = [r for r in self.policy.allow_rules if r.network is not None]
            if not vetted or not all(any(r.matches_address(a) for r in nets) for a in vetted):
                return self._dns_refused(name, EgressReason.NOT_ALLOWED)
        if not vetted:
            reason = EgressReason.REFUSED_ADDRESS if found else EgressReason.NO_ADDRESS
            return self._dns_refused(name, reason, found[0] if found else None)
        expiry = self.clock() + _MEMORY_S
        for address in vetted:
            self._handed_out[address] = (name, expiry)
        if len(self._handed_out) > 4096:
            now = self.clock()
            self._handed_out = {a: v for a, v in self._handed_out.items() if v[1] > now}
        return EgressReason.ALLOWED, vetted

    def _dns_refused(
        self, name: str, reason: EgressReason, address: IPAddress | None = None
    ) -> tuple[EgressReason, list[IPAddress]]:
        self.record(Decision(False, reason), transport="dns", name=name, address=address, port=53)
        return reason, []

    def name_for(self, address: IPAddress) -> str | None:
        """The name the resolver recently answered with ``address``, if any."""
        entry = self._handed_out.get(address)
        if entry is None or entry[1] <= self.clock():
            return None
        return entry[0]

    @property
    def names_matter(self) -> bool:
        """True if a transparent connection could be allowed by a name (worth sniffing)."""
        return self.policy.mode == "allow" and any(
            rule.domain is not None for rule in self.policy.allow_rules
        )


def first_addresses(addresses: Sequence[IPAddress], limit: int = 4) -> list[IPAddress]:
    """At most ``limit`` addresses to try, IPv4 first (the sandbox's own stack is IPv4)."""
    ordered = sorted(addresses, key=lambda a: a.version)
    return ordered[:limit]


__all__ = [
    "Decider",
    "Decision",
    "Upstream",
    "first_addresses",
    "has_ipv6_route",
    "is_local_address",
]
