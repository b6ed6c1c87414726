"""The egress gateway process: one per sandbox link, unprivileged, outside the sandbox.

The runner starts it as ``python -m sandcell_runner.egress.gateway CONFIG`` with
its four listening sockets already bound on the link's gateway address and
inherited (DNS over UDP and TCP, the proxy, the transparent port). Once its code
is loaded it becomes an unprivileged UID (65534 by default) with no groups, no
capabilities and ``no_new_privs``, before it reads a byte from the sandbox.

It talks to the runner over its standard streams, one JSON object a line:

* stdin, from the runner: ``{"seq": N, "policy": EgressPolicy}`` replaces the
  policy for every connection from then on; the gateway answers ``{"ack": N}``
  (without ``policy``: only the answer, after every event decided before it).
  End of input (the runner closed it, or died) stops the gateway.
* stdout, to the runner: ``{"ack": N}`` and ``{"event": EgressEvent}`` lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import resource
import socket
import sys

import msgspec

from sandcell_protocol.addresses import AddressRules, parse_networks
from sandcell_protocol.egress import EgressEvent, EgressPolicy

from . import dns_server
from .decide import Decider, Upstream, has_ipv6_route
from .proxy import Proxy, serve
from .relay import BULK_BYTES

_PR_SET_NO_NEW_PRIVS = 38


class GatewayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the runner hands the gateway on its command line."""

    upstream: str
    upstream_port: int
    allow_nets: str
    policy: EgressPolicy
    dns_udp_fd: int
    dns_tcp_fd: int
    proxy_fd: int
    transparent_fd: int
    uid: int
    bulk_bytes: int = BULK_BYTES
    """What a connection moves on the event loop before splice threads take it (0: none)."""


class _Control(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seq: int
    policy: EgressPolicy | None = None
    """None: only a barrier (every event before the ack has been written)."""


_encoder = msgspec.json.Encoder()


_DEFER_ACCEPT_S = 5
_FLUSH_DELAY_S = 0.005
"""How long events wait to be written together (the ack barrier writes them at once)."""


class _Output:
    """The stdout lines to the runner. Events are buffered and written together a few
    milliseconds later; an ack writes everything before it first, so the runner has
    counted every event decided before the ack.

    Not ``call_soon``: that wrote each event within its own connection's set-up (the
    next loop turn, while the upstream connect is pending), and a write that wakes the
    runner can cost the gateway its CPU on a busy host: profiled under load, that
    flush was among the largest items on the ``CONNECT`` path's wall time."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []
        self._scheduled = False

    def event(self, event: EgressEvent) -> None:
        self._pending.append(_encoder.encode({"event": event}) + b"\n")
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(_FLUSH_DELAY_S, self.flush)

    def ack(self, seq: int) -> None:
        self._pending.append(_encoder.encode({"ack": seq}) + b"\n")
        self.flush()

    def flush(self) -> None:
        self._scheduled = False
        if self._pending:
            data, self._pending = b"".join(self._pending), []
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()


async def _control(decider: Decider, output: _Output) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    decoder = msgspec.json.Decoder(_Control)
    while line := await reader.readline():
        control = decoder.decode(line)
        if control.policy is not None:
            decider.policy = control.policy
        output.ack(control.seq)


def _inherited(fd: int, kind: socket.SocketKind) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind, fileno=fd)
    sock.setblocking(False)
    return sock


async def run(config: GatewayConfig) -> None:
    """Serve until the runner closes stdin."""
    output = _Output()
    decider = Decider(
        rules=AddressRules(parse_networks(config.allow_nets)),
        upstream=Upstream(config.upstream, config.upstream_port, ipv6=has_ipv6_route()),
        emit=output.event,
        policy=config.policy,
    )
    proxy = Proxy(decider, bulk_bytes=config.bulk_bytes)
    proxy_listener = _inherited(config.proxy_fd, socket.SOCK_STREAM)
    # A proxy's client speaks first (its request line), so the kernel hands a
    # connection over only once its first bytes are in (or after _DEFER_ACCEPT_S):
    # accepting and reading it is one wake-up of the gateway, not two. Waking the
    # gateway at the handshake, as before, took the CPU from the client in the middle
    # of its connect: measured under load, the client's TCP connect to the proxy went
    # from 0.6-0.9 ms to 0.15 ms (a direct one: 0.15 ms). Not on the transparent port,
    # where a server may speak first.
    proxy_listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, _DEFER_ACCEPT_S)
    dns = await dns_server.serve(
        decider,
        udp=_inherited(config.dns_udp_fd, socket.SOCK_DGRAM),
        tcp=_inherited(config.dns_tcp_fd, socket.SOCK_STREAM),
    )
    servers = [
        asyncio.ensure_future(
            serve(
                proxy_listener,
                proxy.handle_proxy,
                limit=proxy.limit,
            )
        ),
        asyncio.ensure_future(
            serve(
                _inherited(config.transparent_fd, socket.SOCK_STREAM),
                proxy.handle_transparent,
                limit=proxy.limit,
            )
        ),
    ]
    output.ack(0)
    try:
        await _control(decider, output)
    finally:
        dns.close()
        for task in servers:
            task.cancel()


def _warm_up() -> None:
    """Load now what dnspython imports lazily: after the drop, the interpreter's files
    may be unreadable."""
    import encodings.idna  # noqa: F401

    import dns.rdtypes.ANY
    import dns.rdtypes.IN.A
    import dns.rdtypes.IN.AAAA

    query = dns.message.make_query("warm.example", "A")
    response = dns.message.make_response(query)
    response.answer.append(dns.rrset.from_text("warm.example.", 1, "IN", "A", "192.0.2.1"))
    dns.message.from_wire(response.to_wire())
    dns.message.from_wire(dns.message.make_query("warm.example", "AAAA").to_wire())


def drop_privileges(uid: int) -> None:
    """Become ``uid``:``uid`` with no groups and no capabilities, for good."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if 0 in (os.getuid(), os.geteuid()):
        sys.exit("egress gateway: could not drop root")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m sandcell_runner.egress.gateway CONFIG-JSON")
    config = msgspec.json.decode(sys.argv[1], type=GatewayConfig)
    _warm_up()
    # Room for every connection the caps allow (two sockets and two pipe ends each).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    drop_privileges(config.uid)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(config))


if __name__ == "__main__":
    main()
