#!/usr/bin/env python3
"""Benchmark the egress gateway against a direct connection between the same namespaces.

Sets up, as root, on this machine only:

* a "remote" namespace with the test HTTPS server (``tests/fixtures/egress_remote.py``);
* a sandbox-side namespace linked to the runner's namespace by the runner's own
  egress code (``EgressManager``: veth, nftables table, gateway process), policy
  ``allow_all`` with the remote's network operator-allowed;
* a second, direct veth pair between the two namespaces (the baseline: no
  gateway, one hop).

Then, from the sandbox-side namespace, with curl (its own timers, so process
start-up is not measured), side by side in one run:

* HTTPS download throughput (``--mib`` MiB, median of ``--repeat``): direct,
  through the proxy (``CONNECT``), and through the transparent redirect;
* connection set-up (TCP connect, the proxy's ``CONNECT`` when there is one, and
  the TLS handshake) over ``--connects`` fresh connections each, by one Python
  client in the sandbox-side namespace alternating the two paths (one process,
  so no per-connection process start-up; alternating, so drift hits both):
  p50 direct, p50 through the proxy, and the overhead between them.

Usage: .venv/bin/python scripts/bench_egress.py [--mib 256] [--repeat 3] [--connects 60]
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import json
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
from sandcell_runner.jail.netns import create_netns  # noqa: E402

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
NAME = "allowed.egress.test"


def in_netns(fd: int, argv: list[str]) -> str:
    def enter() -> None:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")

    done = subprocess.run(
        argv, capture_output=True, text=True, pass_fds=(fd,), preexec_fn=enter, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr.strip()[:300]}")
    return done.stdout


def curl(fd: int, ca: Path, url: str, *extra: str) -> float:
    """Bytes per second of one fresh transfer."""
    argv = ["curl", "-s", "-S", "--cacert", str(ca), "-o", "/dev/null", "--noproxy", ""]
    return float(in_netns(fd, [*argv, "-w", "%{speed_download}", *extra, url]))


SETUP_CLIENT = r"""
import socket, ssl, sys, time, json
gateway, name, direct, ca, count = sys.argv[1:5] + [int(sys.argv[5])]
context = ssl.create_default_context(cafile=ca)
def handshake(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    context.wrap_socket(sock, server_hostname=name).close()
def via_direct():
    start = time.perf_counter()
    handshake(socket.create_connection((direct, 443)))
    return time.perf_counter() - start
def via_proxy():
    start = time.perf_counter()
    sock = socket.create_connection((gateway, 3128))
    sock.sendall(f"CONNECT {name}:443 HTTP/1.1\r\nHost: {name}:443\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    handshake(sock)
    return time.perf_counter() - start
times = {"direct": [], "proxy": []}
via_direct(); via_proxy()
for _ in range(count):
    times["direct"].append(via_direct())
    times["proxy"].append(via_proxy())
print(json.dumps(times))
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--connects", type=int, default=60)
    args = parser.parse_args()

    with traversable_dir("bench-egress-") as root:
        remote = RemoteNetwork(root)
        netns = create_netns()
        manager = EgressManager(
            EgressSettings(
                policy=EgressPolicy(mode="allow_all"),
                allow_nets=remote.network,
                upstream=remote.address,
            ),
            unavailable=None,
            state_dir=root / "egress",
        )
        direct_if = f"bd{remote.index:03d}c"
        try:
            manager.start()
            manager.session_netns(netns)
            link = manager.link_for(netns)
            assert link is not None
            # The baseline: the same two namespaces joined directly.
            base = ipaddress.IPv4Address(f"10.215.{remote.index}.0")
            client, server = base + 1, base + 2
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
                    direct_if[:-1] + "r",
                    "netns",
                    remote.name,
                ],
            )
            in_netns(netns.fd, ["ip", "addr", "add", f"{client}/30", "dev", direct_if])
            in_netns(netns.fd, ["ip", "link", "set", direct_if, "up"])
            subprocess.run(
                [
                    "ip",
                    "-n",
                    remote.name,
                    "addr",
                    "add",
                    f"{server}/30",
                    "dev",
                    direct_if[:-1] + "r",
                ],
                check=True,
            )
            subprocess.run(
                ["ip", "-n", remote.name, "link", "set", direct_if[:-1] + "r", "up"], check=True
            )

            size = args.mib * 1024 * 1024
            big = f"https://{NAME}/big?size={size}"
            small = f"https://{NAME}/"
            paths = {
                "direct": ("--resolve", f"{NAME}:443:{server}"),
                "proxy": ("-x", f"http://{link.gateway}:3128"),
                "transparent": ("--resolve", f"{NAME}:443:{remote.address}"),
            }
            for extra in paths.values():  # warm: DNS caches, TLS code, the gateway
                curl(netns.fd, remote.ca, small, *extra)

            speeds: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeat):
                for name, extra in paths.items():
                    speeds[name].append(curl(netns.fd, remote.ca, big, *extra))
            setups: dict[str, list[float]] = json.loads(
                in_netns(
                    netns.fd,
                    [
                        sys.executable,
                        "-c",
                        SETUP_CLIENT,
                        str(link.gateway),
                        NAME,
                        str(server),
                        str(remote.ca),
                        str(args.connects),
                    ],
                )
            )
        finally:
            subprocess.run(["ip", "link", "del", direct_if], capture_output=True)
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
        print(f"  {name:12s} {value:8.1f}   x{ratios[name]:.2f} of direct (median per-round ratio)")
    print(f"connection set-up (TCP [+ CONNECT] + TLS), p50 of {args.connects} (ms):")
    print(f"  direct       {p50['direct']:8.3f}")
    print(f"  proxy        {p50['proxy']:8.3f}")
    overhead = p50["proxy"] - p50["direct"]
    print(f"  overhead     {overhead:8.3f}   (target <= 1 ms)")
    print(f"proxy throughput ratio {ratios['proxy']:.2f} (target >= 0.8)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
