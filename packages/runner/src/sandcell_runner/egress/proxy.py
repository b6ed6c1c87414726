"""The sandbox's HTTP(S) proxy and its transparent TCP redirect; no TLS is ever opened.

Two listeners on the gateway address:

* the **proxy** (what ``HTTP(S)_PROXY`` names): ``CONNECT host:port`` tunnels,
  and absolute-form ``GET http://host/…`` requests, decided by that host;
* the **transparent** port, where nftables sends every other TCP connection of
  the sandbox: its original destination (``SO_ORIGINAL_DST``) is decided as an
  address (CIDR rules); failing that while name rules exist, by the TLS SNI or
  HTTP ``Host`` of its first bytes (resolved again by the gateway itself), and
  only when the client sends nothing first, by the name the resolver recently
  handed that address out for.

A refusal answers at once: ``403`` with ``X-Sandcell-Egress: <reason>`` on the
proxy, a TCP reset on the transparent port. Allowed connections go to the
addresses the gateway resolved and vetted, never to what the client resolved.

Once decided, a connection's bytes are relayed by the event loop while it is short,
then by two threads with ``splice(2)``, in the kernel (``relay.py``). At most
``MAX_CONNECTIONS`` are relayed at once per gateway; past that, new ones are reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import urllib.parse
from collections.abc import Awaitable, Callable

from sandcell_protocol.addresses import IPAddress
from sandcell_protocol.egress import EgressReason, EgressTransport

from .decide import Decider, Decision, first_addresses
from .relay import BULK_BYTES, MAX_CONNECTIONS, LoopRelay, relay
from .sniff import MAX_HEAD_BYTES, RequestHead, request_head, split_host_port, tls_server_name

log = logging.getLogger(__name__)

_SO_ORIGINAL_DST = 80
_HEAD_TIMEOUT_S = 30.0
_SNIFF_TIMEOUT_S = 1.0
_CONNECT_TIMEOUT_S = 10.0
_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
_HOP_BY_HOP = {"proxy-connection", "proxy-authorization", "connection", "keep-alive"}

Handler = Callable[[socket.socket], Awaitable[None]]


def original_destination(sock: socket.socket) -> tuple[IPAddress, int]:
    """Where a redirected connection was going (nftables' DNAT keeps it in conntrack)."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    (port,) = struct.unpack("!H", raw[2:4])
    return ipaddress.IPv4Address(raw[4:8]), port


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the client fails at once."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def _connect(addresses: list[IPAddress], port: int) -> socket.socket | None:
    loop = asyncio.get_running_loop()
    for address in first_addresses(addresses):
        family = socket.AF_INET if address.version == 4 else socket.AF_INET6
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                await loop.sock_connect(sock, (str(address), port))
        except (OSError, TimeoutError):
            sock.close()
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    return None


def _refusal(status: int, reason: str) -> bytes:
    body = f"sandcell egress: {reason}\n".encode()
    text = "Forbidden" if status == 403 else "Bad Gateway" if status == 502 else "Bad Request"
    return (
        f"HTTP/1.1 {status} {text}\r\nX-Sandcell-Egress: {reason}\r\n"
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


async def _read_head(sock: socket.socket) -> tuple[RequestHead | None, bytes]:
    loop = asyncio.get_running_loop()
    data = b""
    async with asyncio.timeout(_HEAD_TIMEOUT_S):
        while len(data) < MAX_HEAD_BYTES:
            chunk = await loop.sock_recv(sock, MAX_HEAD_BYTES - len(data))
            if not chunk:
                break
            data += chunk
            head = request_head(data)
            if head is not None:
                return head, data[head.size :]
    return None, data


async def serve(listener: socket.socket, handler: Handler, *, limit: asyncio.Semaphore) -> None:
    """Accept on ``listener`` forever; each connection runs ``handler`` in its own task."""
    loop = asyncio.get_running_loop()
    listener.setblocking(False)
    tasks: set[asyncio.Task[None]] = set()
    while True:
        conn, _ = await loop.sock_accept(listener)
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Bounded twice: relayed connections (``limit``) and ones still being decided
        # (a client that never sends its request holds a socket for _HEAD_TIMEOUT_S).
        if limit.locked() or len(tasks) >= MAX_CONNECTIONS:
            _reset(conn)
            continue
        task = asyncio.ensure_future(handler(conn))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def _origin_request(head: RequestHead, path: str) -> bytes:
    lines = [f"{head.method} {path} {head.version}"]
    lines += [f"{k}: {v}" for k, v in head.headers if k.lower() not in _HOP_BY_HOP]
    # One request per upstream connection: a second request on a kept-alive client
    # connection could name another host.
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Proxy:
    """Both listeners' connection handlers over one ``Decider``."""

    def __init__(
        self,
        decider: Decider,
        *,
        max_connections: int = MAX_CONNECTIONS,
        bulk_bytes: int = BULK_BYTES,
    ) -> None:
        self._decider = decider
        self.limit = asyncio.Semaphore(max_connections)
        """Held by each relayed connection until both its directions end."""
        self._bulk_bytes = bulk_bytes
        """Moved on the event loop before the splice threads take a connection (0: none)."""

    async def _relay(
        self, client: socket.socket, upstream: socket.socket, first: bytes, reply: bytes = b""
    ) -> None:
        loop = asyncio.get_running_loop()
        await self.limit.acquire()

        def done() -> None:
            loop.call_soon_threadsafe(self.limit.release)

        if self._bulk_bytes:
            LoopRelay(
                client,
                upstream,
                done=done,
                to_upstream=first,
                to_client=reply,
                bulk_bytes=self._bulk_bytes,
            )
        else:
            relay(client, upstream, done=done, to_upstream=first, to_client=reply)

    async def _answer(self, sock: socket.socket, data: bytes) -> None:
        with contextlib.suppress(OSError):
            await asyncio.get_running_loop().sock_sendall(sock, data)
        sock.close()

    async def handle_proxy(self, sock: socket.socket) -> None:
        """One client of the explicit proxy."""
        try:
            head, rest = await _read_head(sock)
        except (TimeoutError, OSError):
            sock.close()
            return
        if head is None:
            await self._answer(sock, _refusal(400, "bad_request"))
            return
        transport: EgressTransport
        if head.method == "CONNECT":
            target, transport, path = split_host_port(head.target, 443), "connect", ""
        else:
            url = urllib.parse.urlsplit(head.target)
            transport = "http"
            if url.scheme == "http" and url.netloc:
                target = split_host_port(url.netloc.rpartition("@")[2], 80)
                path = urllib.parse.urlunsplit(("", "", url.path or "/", url.query, ""))
            elif not url.scheme and (host := head.header("host")):
                target, path = split_host_port(host, 80), head.target
            else:
                target, path = None, ""
        if target is None:
            await self._answer(sock, _refusal(400, "bad_request"))
            return
        host, port = target
        decision = await self._decider.by_host(host, port, transport=transport)
        if not decision.allowed:
            await self._answer(sock, _refusal(403, decision.reason.value))
            return
        upstream = await _connect(decision.addresses, port)
        if upstream is None:
            await self._answer(sock, _refusal(502, "connect_failed"))
            return
        if head.method == "CONNECT":
            first, reply = rest, _ESTABLISHED
        else:
            first, reply = _origin_request(head, path) + rest, b""
        await self._relay(sock, upstream, first, reply)

    async def handle_transparent(self, sock: socket.socket) -> None:
        """One redirected TCP connection of the sandbox."""
        try:
            address, port = original_destination(sock)
        except OSError:
            _reset(sock)
            return
        decider = self._decider
        first = b""
        recorded = False
        if not decider.address_ok(address):
            decision = Decision(False, EgressReason.REFUSED_ADDRESS)
        else:
            # An address rule first: it names this destination outright.
            verdict = decider.policy.decide(name=None, addresses=[address], port=port)
            decision = Decision(verdict.allowed, verdict.reason, [address])
            if not verdict.allowed and decider.names_matter:
                # A name in the first bytes decides, never the address's other names: one
                # address serves many names (a CDN), and only the one asked for counts.
                first = await self._sniff(sock)
                name = tls_server_name(first) or _host_of(first)
                if name is not None:
                    transport: EgressTransport = "tls" if first[:1] == b"\x16" else "http"
                    decision = await decider.by_host(name, port, transport=transport)
                    recorded = True
                elif (handed_out := decider.name_for(address)) is not None:
                    # Nothing to read (a protocol whose server speaks first): the name
                    # the resolver gave this address out for.
                    verdict = decider.policy.decide(name=handed_out, addresses=[address], port=port)
                    decision = Decision(verdict.allowed, verdict.reason, [address])
        if not recorded:
            if not decision.allowed and decision.reason is EgressReason.NOT_ALLOWED:
                decision = Decision(False, EgressReason.UNKNOWN_DESTINATION)
            decider.record(
                Decision(decision.allowed, decision.reason, decision.addresses),
                transport="tcp",
                name=decider.name_for(address) if decision.allowed else None,
                address=address,
                port=port,
            )
        if not decision.allowed:
            _reset(sock)
            return
        upstream = await _connect(decision.addresses, port)
        if upstream is None:
            _reset(sock)
            return
        await self._relay(sock, upstream, first)

    async def _sniff(self, sock: socket.socket) -> bytes:
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(_SNIFF_TIMEOUT_S):
                return await asyncio.get_running_loop().sock_recv(sock, MAX_HEAD_BYTES)
        return b""


def _host_of(first: bytes) -> str | None:
    head = request_head(first)
    host = head.header("host") if head is not None else None
    target = split_host_port(host, 80) if host else None
    return target[0] if target else None


__all__ = ["MAX_CONNECTIONS", "Proxy", "original_destination", "serve"]
