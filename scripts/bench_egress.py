#!/usr/bin/env python3
"""Benchmark the egress gateway against a direct connection between the same namespaces.

Sets up, as root, on this machine only:

* a "remote" namespace with the test HTTPS server (``tests/fixtures/egress_remote.py``);
* two sandbox-side namespaces, each linked to the runner's namespace by the
  runner's own egress code (``EgressManager``: veth, nftables table, gateway
  process), policy ``allow_all`` with the remote's network operator-allowed, one
  per gateway variant of the A/B (``VARIANTS``): ``threads`` hands every
  connection to its splice threads at once (``bulk_bytes=0``, the gateway before
  the loop relay), ``loop`` (the default) relays a connection on its event loop
  until it turns out bulk;
* a direct veth pair between the first of them and the remote (the baseline: no
  gateway, one hop).

Then, from the sandbox-side namespace, with curl (its own timers, so process
start-up is not measured), side by side in one run:

* HTTPS download throughput (``--mib`` MiB, median of ``--repeat``): direct,
  through each gateway's proxy (``CONNECT``), and through the default gateway's
  transparent redirect;
* connection set-up (TCP connect, the proxy's ``CONNECT`` when there is one, and
  the TLS handshake) over ``--connects`` fresh connections each, by one Python
  client alternating the three paths (one process, so no per-connection process
  start-up; it enters each path's namespace before making its socket, outside
  the timed part; alternating, so drift hits all three): p50 of each, and the
  overhead of each gateway over direct (p50 minus p50, and the median of the
  per-round differences).

Usage: .venv/bin/python scripts/bench_egress.py [--mib 256] [--repeat 3] [--connects 60]
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.egress_remote import RemoteNetwork  # noqa: E402
from tests.fixtures.paths import traversable_dir  # noqa: E402

from sandcell_protocol import EgressPolicy  # noqa: E402
from sandcell_runner.egress.manager import EgressManager  # noqa: E402
from sandcell_runner.egress.settings import EgressSettings  # noqa: E402
from sandcell_runner.jail.netns import SessionNetns, create_netns  # noqa: E402

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
NAME = "allowed.egress.test"


def in_netns(fd: int, argv: list[str], *, pass_fds: tuple[int, ...] = ()) -> str:
    def enter() -> None:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")

    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        pass_fds=(fd, *pass_fds),
        preexec_fn=enter,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr.strip()[:300]}")
    return done.stdout


def curl(fd: int, ca: Path, url: str, *extra: str) -> float:
    """Bytes per second of one fresh transfer."""
    argv = ["curl", "-s", "-S", "--cacert", str(ca), "-o", "/dev/null", "--noproxy", ""]
    return float(in_netns(fd, [*argv, "-w", "%{speed_download}", *extra, url]))


SETUP_CLIENT = r"""
import ctypes, json, os, socket, ssl, sys, time
name, direct, ca, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
gateways = [arg.split("=") for arg in sys.argv[5:]]  # label=netns-fd=gateway-address
libc = ctypes.CDLL(None, use_errno=True)
context = ssl.create_default_context(cafile=ca)
home = os.open("/proc/self/ns/net", os.O_RDONLY)
def socket_in(fd):
    if libc.setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    sock = socket.socket()
    libc.setns(home, 0x40000000)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
def handshake(sock):
    context.wrap_socket(sock, server_hostname=name).close()
def via_direct():
    sock = socket_in(home)
    start = time.perf_counter()
    sock.connect((direct, 443))
    handshake(sock)
    return time.perf_counter() - start
def via_proxy(fd, gateway):
    sock = socket_in(fd)
    start = time.perf_counter()
    sock.connect((gateway, 3128))
    sock.sendall(f"CONNECT {name}:443 HTTP/1.1\r\nHost: {name}:443\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    handshake(sock)
    return time.perf_counter() - start
paths = {"direct": via_direct}
for label, fd, gateway in gateways:
    paths[label] = lambda fd=int(fd), gateway=gateway: via_proxy(fd, gateway)
times = {label: [] for label in paths}
for path in paths.values():
    path()
for _ in range(count):
    for label, path in paths.items():
        times[label].append(path())
print(json.dumps(times))
"""


VARIANTS: dict[str, dict[str, object]] = {
    "threads": {"bulk_bytes": 0},
    "loop": {},
}
"""Each gateway of the A/B: its ``EgressSettings`` beyond the defaults (``loop`` is the
runner's default gateway)."""


def _sandbox(
    remote: RemoteNetwork, root: Path, label: str, settings: dict[str, object]
) -> tuple[EgressManager, SessionNetns, str]:
    """A sandbox-side namespace linked by its own manager and gateway: (manager, netns,
    gateway address)."""
    netns = create_netns()
    manager = EgressManager(
        EgressSettings(
            policy=EgressPolicy(mode="allow_all"),
            allow_nets=remote.network,
            upstream=remote.address,
            **settings,  # type: ignore[arg-type]
        ),
        unavailable=None,
        state_dir=root / f"egress-{label}",
    )
    manager.start()
    manager.session_netns(netns)
    link = manager.link_for(netns)
    assert link is not None
    return manager, netns, str(link.gateway)


def _cpu_s(manager: EgressManager, netns: SessionNetns) -> float:
    """CPU seconds (user + system) the gateway serving ``netns`` has used so far."""
    pid = manager.gateway_pid(netns)
    assert pid is not None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _direct_link(remote: RemoteNetwork, netns: SessionNetns, direct_if: str) -> str:
    """The baseline: ``netns`` and the remote joined directly; the remote's address on it."""
    base = ipaddress.IPv4Address(f"10.215.{remote.index}.0")
    client, server = base + 1, base + 2
    peer = direct_if[:-1] + "r"
    in_netns(
        netns.fd,
        [
            "ip",
            "link",
            "add",
            direct_if,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            remote.name,
        ],
    )
    in_netns(netns.fd, ["ip", "addr", "add", f"{client}/30", "dev", direct_if])
    in_netns(netns.fd, ["ip", "link", "set", direct_if, "up"])
    subprocess.run(
        ["ip", "-n", remote.name, "addr", "add", f"{server}/30", "dev", peer], check=True
    )
    subprocess.run(["ip", "-n", remote.name, "link", "set", peer, "up"], check=True)
    return str(server)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--connects", type=int, default=60)
    args = parser.parse_args()

    with traversable_dir("bench-egress-") as root:
        remote = RemoteNetwork(root)
        direct_if = f"bd{remote.index:03d}c"
        made: dict[str, tuple[EgressManager, SessionNetns, str]] = {}
        try:
            for label, settings in VARIANTS.items():
                made[label] = _sandbox(remote, root, label, settings)
            home_ns = made["threads"][1]
            loop_ns = made["loop"][1]
            server = _direct_link(remote, home_ns, direct_if)

            size = args.mib * 1024 * 1024
            big = f"https://{NAME}/big?size={size}"
            small = f"https://{NAME}/"
            paths = {
                "direct": (home_ns, ("--resolve", f"{NAME}:443:{server}")),
                **{
                    f"proxy {label}": (netns, ("-x", f"http://{gateway}:3128"))
                    for label, (_, netns, gateway) in made.items()
                },
                "transparent": (loop_ns, ("--resolve", f"{NAME}:443:{remote.address}")),
            }
            for netns, extra in paths.values():  # warm: DNS caches, TLS code, the gateways
                curl(netns.fd, remote.ca, small, *extra)

            speeds: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeat):
                for name, (netns, extra) in paths.items():
                    speeds[name].append(curl(netns.fd, remote.ca, big, *extra))
            cpu_before = {label: _cpu_s(m, netns) for label, (m, netns, _) in made.items()}
            setups: dict[str, list[float]] = json.loads(
                in_netns(
                    home_ns.fd,
                    [
                        sys.executable,
                        "-c",
                        SETUP_CLIENT,
                        NAME,
                        server,
                        str(remote.ca),
                        str(args.connects),
                        *(f"{label}={ns.fd}={gw}" for label, (_, ns, gw) in made.items()),
                    ],
                    pass_fds=tuple(netns.fd for _, netns, _ in made.values()),
                )
            )
            # Each gateway's CPU over the set-up run: per connection (warm-up included).
            cpu_us = {
                label: (_cpu_s(m, netns) - cpu_before[label]) * 1e6 / (args.connects + 1)
                for label, (m, netns, _) in made.items()
            }
        finally:
            subprocess.run(["ip", "link", "del", direct_if], capture_output=True)
            for manager, netns, _ in made.values():
                manager.close()
                netns.close()
            remote.close()

    mbps = {name: statistics.median(v) / 1e6 for name, v in speeds.items()}
    # Each round ran the paths back to back: per-round ratios cancel the machine's drift.
    ratios = {
        name: statistics.median(p / d for p, d in zip(v, speeds["direct"], strict=True))
        for name, v in speeds.items()
    }
    p50 = {name: statistics.median(v) * 1000 for name, v in setups.items()}
    print(f"HTTPS download, {args.mib} MiB, median of {args.repeat} (MB/s):")
    for name, value in mbps.items():
        print(f"  {name:14s} {value:8.1f}   x{ratios[name]:.2f} of direct (median per-round ratio)")
    print(f"connection set-up (TCP [+ CONNECT] + TLS), p50 of {args.connects} (ms):")
    for name, value in p50.items():
        print(f"  {name:14s} {value:8.3f}")
    for name in VARIANTS:
        rounds = [(p - d) * 1000 for p, d in zip(setups[name], setups["direct"], strict=True)]
        print(
            f"  overhead {name:8s} {p50[name] - p50['direct']:8.3f}   (per-round median"
            f" {statistics.median(rounds):.3f}; target <= 1 ms;"
            f" gateway CPU {cpu_us[name]:.0f} us a connection)"
        )
    print(f"proxy throughput ratio {ratios['proxy loop']:.2f} (target >= 0.8)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
