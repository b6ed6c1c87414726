"""The wire between a sandbox's network namespace and the runner: a veth pair and nftables.

``attach`` gives a namespace (normally holding only ``lo``) one veth end with a
default route to the other end, which stays in the runner's own namespace and
carries the gateway's address. A per-link nftables table in the runner's
namespace, keyed by the runner-side interface name, then decides what of the
sandbox's traffic exists at all:

* UDP and TCP to port 53 of *any* address are redirected to the gateway's DNS
  resolver (a job that ignores ``/etc/resolv.conf`` still asks the runner);
* TCP to the gateway's proxy port passes; every other TCP connection is
  redirected to the gateway's transparent port, which reads its original
  destination (``SO_ORIGINAL_DST``) and decides like the proxy;
* nothing else from the link reaches the runner's namespace (other ports of the
  gateway address answer with a TCP reset), and nothing is forwarded.

The table and the interfaces live where the job cannot reach them: the namespace
was made by the runner's (initial) user namespace, and the job's user namespace
holds no capability over it. Creating all of this needs root (``CAP_NET_ADMIN``).
Interfaces are named from their link index, so two runners on one host claim
distinct links by ``ip link add`` failing on a name already taken.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import ipaddress
import logging
import os
import random
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from ..jail.capabilities import CAP_NET_ADMIN, CAP_SYS_ADMIN, effective_capabilities

log = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
TABLE_PREFIX = "sandcell_egress_"
_IF_PREFIX = "sce"
_TABLE_RE = re.compile(rf"^table inet ({TABLE_PREFIX}([0-9a-f]{{4}}))$", re.MULTILINE)


class PlumbingError(OSError):
    """The veth pair or the nftables table could not be set up."""


@dataclass(frozen=True, slots=True)
class GatewayPorts:
    """The gateway's ports on its link address."""

    dns: int = 53
    proxy: int = 3128
    transparent: int = 3129


@dataclass(frozen=True, slots=True)
class Link:
    """One attached namespace: its interfaces, addresses and nftables table."""

    index: int
    host_if: str
    jail_if: str
    gateway: IPv4Address
    jail_address: IPv4Address
    table: str


def tools_missing(*, status: Path = Path("/proc/self/status")) -> str | None:
    """Why this runner cannot plumb links (None when it can).

    Root alone is not enough: a container's root holds only the capabilities its
    engine granted, so the check reads them (and asks nftables once) rather than
    letting ``/health`` claim a mechanism whose first link would fail.
    """
    if os.geteuid() != 0:
        return "egress needs a root runner (veth pairs and nftables)"
    capabilities = effective_capabilities(status)
    for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not capabilities & (1 << bit):
            return f"egress needs {name} (veth pairs, nftables and namespaces)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"egress needs the {tool!r} tool (iproute2, nftables)"
    try:
        _run(["nft", "list", "tables"])
    except PlumbingError as exc:
        return f"egress needs nftables in this kernel: {exc}"
    return None


def _run(
    argv: Sequence[str],
    *,
    netns_fd: int | None = None,
    stdin: str | None = None,
    extra_fds: Sequence[int] = (),
) -> None:
    preexec: Callable[[], None] | None = None
    if netns_fd is not None:
        fd = netns_fd

        def preexec() -> None:
            # In the forked child only: the runner's own threads keep their namespace.
            if _libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")

    try:
        subprocess.run(
            argv,
            input=stdin,
            text=True,
            check=True,
            capture_output=True,
            timeout=30,
            pass_fds=(*((netns_fd,) if netns_fd is not None else ()), *extra_fds),
            preexec_fn=preexec,
        )
    except subprocess.CalledProcessError as exc:
        raise PlumbingError(f"{argv[0]} {argv[1]}: {exc.stderr.strip()[:500]}") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PlumbingError(f"{argv[0]}: {exc}") from None


def _link_net(subnet: IPv4Network, index: int) -> tuple[IPv4Address, IPv4Address]:
    base = int(subnet.network_address) + 4 * index
    return IPv4Address(base + 1), IPv4Address(base + 2)


def _ruleset(link: Link, ports: GatewayPorts) -> str:
    gw, hif = link.gateway, link.host_if
    tcp_ports = f"{ports.dns}, {ports.proxy}, {ports.transparent}"
    return f"""
table inet {link.table} {{
    chain prerouting {{
        type nat hook prerouting priority dstnat - 10; policy accept;
        iifname "{hif}" udp dport 53 dnat ip to {gw}:{ports.dns}
        iifname "{hif}" tcp dport 53 dnat ip to {gw}:{ports.dns}
        iifname "{hif}" ip daddr {gw} tcp dport {ports.proxy} accept
        iifname "{hif}" meta nfproto ipv4 meta l4proto tcp dnat ip to {gw}:{ports.transparent}
    }}
    chain input_filter {{
        type filter hook input priority filter - 10; policy accept;
        iifname "{hif}" ip daddr {gw} udp dport {ports.dns} accept
        iifname "{hif}" ip daddr {gw} tcp dport {{ {tcp_ports} }} accept
        iifname "{hif}" meta l4proto tcp reject with tcp reset
        iifname "{hif}" drop
    }}
    chain forward_drop {{
        type filter hook forward priority filter - 10; policy accept;
        iifname "{hif}" drop
        oifname "{hif}" drop
    }}
}}
"""


def attach(
    netns_fd: int,
    *,
    subnet: IPv4Network,
    ports: GatewayPorts,
    choose: Callable[[int], int] = random.randrange,
) -> Link:
    """Give the namespace behind ``netns_fd`` a link to the runner; see the module docstring."""
    slots = subnet.num_addresses // 4
    start = choose(slots)
    # The runner's own namespace, named to ``ip`` by a descriptor it inherits: not by
    # pid, since ``/proc/<runner>/ns`` is closed to a child without CAP_SYS_PTRACE (a
    # container's root) while the runner is not dumpable.
    own_netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for attempt in range(64):
            index = (start + attempt) % slots
            host_if, jail_if = f"{_IF_PREFIX}{index:04x}h", f"{_IF_PREFIX}{index:04x}j"
            try:
                # Made inside the namespace, the host end moved out to the runner's.
                _run(
                    [
                        "ip",
                        "link",
                        "add",
                        jail_if,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        host_if,
                        "netns",
                        f"/proc/self/fd/{own_netns}",
                    ],
                    netns_fd=netns_fd,
                    extra_fds=(own_netns,),
                )
            except PlumbingError as exc:
                if "File exists" in str(exc):
                    continue
                raise
            break
        else:
            raise PlumbingError("no free egress link in SANDCELL_RUNNER_EGRESS_SUBNET")
    finally:
        os.close(own_netns)
    gateway, jail_address = _link_net(subnet, index)
    link = Link(
        index=index,
        host_if=host_if,
        jail_if=jail_if,
        gateway=gateway,
        jail_address=jail_address,
        table=f"{TABLE_PREFIX}{index:04x}",
    )
    try:
        # The table first: no packet of the link is ever unfiltered.
        _run(["nft", "-f", "-"], stdin=_ruleset(link, ports))
        _run(["ip", "addr", "add", f"{gateway}/30", "dev", host_if])
        _run(["ip", "link", "set", host_if, "up"])
        _run(
            ["ip", "-batch", "-"],
            netns_fd=netns_fd,
            stdin=(
                f"addr add {jail_address}/30 dev {jail_if}\n"
                f"link set {jail_if} up\n"
                f"route add default via {gateway} dev {jail_if}\n"
            ),
        )
    except PlumbingError:
        detach(link)
        raise
    return link


def detach(link: Link) -> None:
    """Remove the link's table and interfaces; quiet when they are already gone."""
    with contextlib.suppress(PlumbingError):
        # Deleting one end of a veth pair deletes both.
        _run(["ip", "link", "del", link.host_if])
    with contextlib.suppress(PlumbingError):
        _run(["nft", "delete", "table", "inet", link.table])


def reap_leftovers() -> int:
    """Delete egress tables whose runner-side interface is gone (a runner that died)."""
    try:
        out = subprocess.run(
            ["nft", "list", "tables"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    reaped = 0
    for table, index in _TABLE_RE.findall(out):
        if not os.path.exists(f"/sys/class/net/{_IF_PREFIX}{index}h"):
            with contextlib.suppress(PlumbingError):
                _run(["nft", "delete", "table", "inet", table])
                reaped += 1
    return reaped


def parse_subnet(text: str) -> IPv4Network:
    """The link subnet setting: an IPv4 network of at least 4 addresses."""
    network = ipaddress.ip_network(text, strict=False)
    if not isinstance(network, IPv4Network) or network.prefixlen > 30:
        raise ValueError(f"must be an IPv4 network of /30 or larger, got {text!r}")
    return network


__all__ = [
    "TABLE_PREFIX",
    "GatewayPorts",
    "Link",
    "PlumbingError",
    "attach",
    "detach",
    "parse_subnet",
    "reap_leftovers",
    "tools_missing",
]
