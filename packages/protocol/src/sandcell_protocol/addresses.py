"""Which network destinations are always refused, in every spelling.

One implementation for every side that opens connections on someone else's
behalf: the orchestrator's webhook deliveries and the runner's egress gateway.
Refused unless the operator allow-listed a network that holds it:

* loopback, "this network" (``0.0.0.0/8``: 0.0.0.0 connects to the local host on
  Linux), link-local and the cloud metadata addresses (``169.254.169.254``,
  ``fd00:ec2::254``, Azure's WireServer ``168.63.129.16``);
* the private ranges (RFC 1918, unique local ``fc00::/7``), carrier-grade NAT
  (``100.64.0.0/10``), and the rest of IANA's special-purpose registries;
* any address that reaches one of those through IPv6: IPv4-mapped
  (``::ffff:0:0/96``), IPv4-compatible (``::/96``), 6to4 (``2002::/16``) and NAT64
  (``64:ff9b::/96``) are judged as the IPv4 address they carry;
* the names that always mean this machine or a metadata service, whatever DNS
  says (``localhost``, ``*.localhost``, ``metadata.google.internal``, …).

The special-purpose ranges are listed here rather than left to ``is_global``,
whose answers differ between Python patch releases (3.11 calls multicast,
site-local, 6to4 and IPv4-compatible addresses global).

A host's *own* public addresses are not knowable from an address alone; the
runner's gateway refuses those separately (it asks its kernel).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

__all__ = [
    "REFUSED_NAMES",
    "REFUSED_NETS",
    "AddressRules",
    "IPAddress",
    "IPNetwork",
    "embedded_ipv4",
    "is_refused_name",
    "literal_address",
    "parse_networks",
]

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

# IANA's special-purpose registries: nothing here is a destination on the internet.
REFUSED_NETS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",  # "this network"; 0.0.0.0 connects to the local host on Linux
        "10.0.0.0/8",
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",
        "169.254.0.0/16",  # link-local, cloud metadata
        "168.63.129.16/32",  # Azure's WireServer and metadata host (a public address)
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",  # 6to4 relay anycast
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, broadcast
        "::/96",  # unspecified, loopback, IPv4-compatible
        "::ffff:0:0:0/96",  # IPv4-translated (SIIT)
        "64:ff9b:1::/48",  # local-use NAT64
        "100::/64",  # discard-only
        "2001::/23",  # IETF protocol assignments, Teredo
        "2001:db8::/32",
        "3fff::/20",
        "5f00::/16",  # SRv6 SIDs
        "fc00::/7",  # unique local (fd00:ec2::254 is AWS's IPv6 metadata address)
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated, still routed by some stacks)
        "ff00::/8",  # multicast
    )
)
"""The always-refused networks (an operator's allow list can open parts of them)."""

REFUSED_NAMES: tuple[str, ...] = (
    "localhost",
    "metadata",
    "metadata.google.internal",
    "metadata.goog",
    "metadata.azure.internal",
    "instance-data",
    "instance-data.ec2.internal",
)
"""Names that mean this machine or a cloud metadata service, whatever DNS answers.

Every name under ``localhost`` (RFC 6761) counts too; see ``is_refused_name``."""

_NAT64 = IPv6Network("64:ff9b::/96")


def embedded_ipv4(address: IPv6Address) -> IPv4Address | None:
    """The IPv4 address a packet to ``address`` really goes to, if it is a translation."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _is_public(address: IPAddress) -> bool:
    if any(address in net for net in REFUSED_NETS):
        return False
    special = (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or (isinstance(address, IPv6Address) and address.is_site_local)
    )
    return address.is_global and not special


def literal_address(host: str) -> IPAddress | None:
    """``host`` as an address if it is one in any form ``getaddrinfo`` reads without DNS.

    ``127.1``, ``0x7f.1``, ``2130706433``, ``[::ffff:127.0.0.1]`` and
    ``fe80::1%25eth0`` all count; a name gives None.
    """
    # "127.0.0.1." goes to DNS, not the numeric parser, but no public host is named so.
    bare = host.strip("[]").removesuffix(".").replace("%25", "%")
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(bare)
    try:
        # inet_aton is what getaddrinfo uses for numeric IPv4: "127.1", "0x7f.1", "2130706433".
        packed = socket.inet_aton(bare)
    except OSError:
        return None
    return IPv4Address(packed)


def is_refused_name(name: str) -> bool:
    """True for a name that always means this machine or a metadata service."""
    lowered = name.rstrip(".").lower()
    return lowered in REFUSED_NAMES or lowered.endswith(".localhost")


def parse_networks(text: str) -> tuple[IPNetwork, ...]:
    """``"10.0.0.0/8, fd00::/8"`` as networks; ``ValueError`` names the bad entry."""
    networks: list[IPNetwork] = []
    for item in text.replace(",", " ").split():
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not a network (CIDR)") from None
    return tuple(networks)


@dataclass(frozen=True, slots=True)
class AddressRules:
    """Which addresses may be connected to: public ones, plus ``allow_nets``."""

    allow_nets: tuple[IPNetwork, ...] = ()
    """Networks the operator allows although not public (on-prem services, tests)."""

    def allows(self, address: IPAddress) -> bool:
        """True unless ``address`` is always refused (and not in ``allow_nets``)."""
        if any(address in net for net in self.allow_nets):
            return True
        if isinstance(address, IPv6Address):
            embedded = embedded_ipv4(address)
            if embedded is not None:
                return self.allows(embedded)
        return _is_public(address)

    def allows_name(self, name: str) -> bool:
        """False for a loopback or metadata name, unless its loopback is allowed.

        ``localhost`` may resolve to 127.0.0.1 and ``::1``: both must be allowed.
        """
        if not is_refused_name(name):
            return True
        lowered = name.rstrip(".").lower()
        if lowered == "localhost" or lowered.endswith(".localhost"):
            return all(self.allows(a) for a in (IPv4Address("127.0.0.1"), IPv6Address("::1")))
        return False

    def vetted(self, addresses: Iterable[IPAddress]) -> list[IPAddress]:
        """``addresses`` in order and without repeats, mapped IPv6 as IPv4, refused ones out."""
        found = dict.fromkeys(
            item.ipv4_mapped if isinstance(item, IPv6Address) and item.ipv4_mapped else item
            for item in addresses
        )
        return [address for address in found if self.allows(address)]
