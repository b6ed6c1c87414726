"""``Gateway``: the runner's hold on one link and the gateway process serving it.

``spawn_gateway`` binds the gateway's sockets on the link's address, starts
``python -m sandcell_runner.egress.gateway`` with them and the policy, and writes
the ``resolv.conf`` its jobs get; ``Gateway.stop`` ends the process and removes the
link and the file. What goes over the process's stdin and stdout (policies, acks,
events) is the manager's (``manager.py``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import msgspec

from sandcell_protocol import EgressPolicy

from ..jail.netns import SessionNetns
from .plumbing import GatewayPorts, Link, detach
from .settings import EgressSettings

__all__ = ["PORTS", "Gateway", "spawn_gateway"]

PORTS = GatewayPorts()
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")


class Gateway:
    """One link and the gateway process serving it."""

    def __init__(
        self,
        link: Link,
        process: subprocess.Popen[bytes],
        resolv_conf: Path,
        netns: SessionNetns,
    ) -> None:
        self.link = link
        self.netns = netns
        self.process = process
        self.resolv_conf = resolv_conf
        self.env = {
            **dict.fromkeys(_PROXY_VARS, f"http://{link.gateway}:{PORTS.proxy}"),
            "NO_PROXY": "localhost,127.0.0.1,::1",
            "no_proxy": "localhost,127.0.0.1,::1",
        }
        self._acks: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.ready = self.expect(0)

    def expect(self, seq: int) -> threading.Event:
        with self._lock:
            return self._acks.setdefault(seq, threading.Event())

    def acked(self, seq: int) -> None:
        self.expect(seq).set()

    def forget(self, seq: int) -> None:
        with self._lock:
            self._acks.pop(seq, None)

    def stop(self) -> None:
        """End the process (EOF on its stdin, then a kill), remove the link and file."""
        process = self.process
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        detach(self.link)
        with contextlib.suppress(OSError):
            self.resolv_conf.unlink()


def spawn_gateway(
    link: Link,
    policy: EgressPolicy,
    netns: SessionNetns,
    *,
    settings: EgressSettings,
    state_dir: Path,
) -> Gateway:
    """Start the gateway process serving ``link`` (not yet ready: see ``Gateway.ready``)."""
    address = str(link.gateway)
    sockets = [
        _bound(address, PORTS.dns, socket.SOCK_DGRAM),
        _bound(address, PORTS.dns, socket.SOCK_STREAM),
        _bound(address, PORTS.proxy, socket.SOCK_STREAM),
        _bound(address, PORTS.transparent, socket.SOCK_STREAM),
    ]
    try:
        fds = [s.fileno() for s in sockets]
        config = {
            "upstream": settings.upstream,
            "upstream_port": settings.upstream_port,
            "allow_nets": settings.allow_nets,
            "policy": policy,
            "uid": settings.uid,
            "bulk_bytes": settings.bulk_bytes,
            "dns_udp_fd": fds[0],
            "dns_tcp_fd": fds[1],
            "proxy_fd": fds[2],
            "transparent_fd": fds[3],
        }
        # The gateway drops to the unprivileged UID itself, once its code is loaded
        # (the interpreter may live where that UID cannot read). Only what the
        # interpreter needs is in its environment: the runner's token stays out.
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sandcell_runner.egress.gateway",
                msgspec.json.encode(config).decode(),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=fds,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
        )
    finally:
        for sock in sockets:
            sock.close()
    state_dir.mkdir(parents=True, exist_ok=True)
    resolv = state_dir / f"resolv-{link.host_if}.conf"
    resolv.write_text(f"nameserver {link.gateway}\noptions timeout:2 attempts:2\n")
    os.chmod(resolv, 0o644)
    return Gateway(link, process, resolv, netns)


def _bound(address: str, port: int, kind: socket.SocketKind) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        if kind == socket.SOCK_STREAM:
            sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock
