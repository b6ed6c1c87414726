"""The sandbox's HTTP(S) proxy and its transparent TCP redirect; no TLS is ever opened.

Two listeners on the gateway address:

* the **proxy** (what ``HTTP(S)_PROXY`` names): ``CONNECT host:port`` tunnels,
  and absolute-form ``GET http://host/…`` requests, decided by that host;
* the **transparent** port, where nftables sends every other TCP connection of
  the sandbox: its original destination (``SO_ORIGINAL_DST``) is decided as an
  address (CIDR rules), then as the name the resolver recently answered with it,
  and, failing both while name rules exist, by the TLS SNI or HTTP ``Host`` of
  the first bytes, resolved again by the gateway itself.

A refusal answers at once: ``403`` with ``X-Sandcell-Egress: <reason>`` on the
proxy, a TCP reset on the transparent port. Allowed connections go to the
addresses the gateway resolved and vetted, never to what the client resolved.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import urllib.parse

from sandcell_protocol.addresses import IPAddress
from sandcell_protocol.egress import EgressReason, EgressTransport

from .decide import Decider, Decision, first_addresses
from .sniff import MAX_HEAD_BYTES, RequestHead, request_head, split_host_port, tls_server_name

log = logging.getLogger(__name__)

_SO_ORIGINAL_DST = 80
_CHUNK = 256 * 1024
_HEAD_TIMEOUT_S = 30.0
_SNIFF_TIMEOUT_S = 1.5
_CONNECT_TIMEOUT_S = 10.0
_HOP_BY_HOP = {"proxy-connection", "proxy-authorization", "connection", "keep-alive"}


def original_destination(sock: socket.socket) -> tuple[IPAddress, int]:
    """Where a redirected connection was going (nftables' DNAT keeps it in conntrack)."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    (port,) = struct.unpack("!H", raw[2:4])
    return ipaddress.IPv4Address(raw[4:8]), port


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0): the client fails at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()


async def _splice(
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    try:
        await asyncio.gather(_pipe(client[0], upstream[1]), _pipe(upstream[0], client[1]))
    finally:
        for writer in (client[1], upstream[1]):
            writer.close()


async def _open(
    addresses: list[IPAddress], port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    for address in first_addresses(addresses):
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(str(address), port, limit=_CHUNK)
        except (OSError, TimeoutError):
            continue
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer
    return None


def _refusal(status: int, reason: str) -> bytes:
    body = f"sandcell egress: {reason}\n".encode()
    text = "Forbidden" if status == 403 else "Bad Gateway" if status == 502 else "Bad Request"
    return (
        f"HTTP/1.1 {status} {text}\r\nX-Sandcell-Egress: {reason}\r\n"
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


async def _read_head(reader: asyncio.StreamReader) -> tuple[RequestHead | None, bytes]:
    data = b""
    async with asyncio.timeout(_HEAD_TIMEOUT_S):
        while len(data) < MAX_HEAD_BYTES:
            chunk = await reader.read(MAX_HEAD_BYTES - len(data))
            if not chunk:
                break
            data += chunk
            head = request_head(data)
            if head is not None:
                return head, data[head.size :]
    return None, data


def _origin_request(head: RequestHead, path: str) -> bytes:
    lines = [f"{head.method} {path} {head.version}"]
    lines += [f"{k}: {v}" for k, v in head.headers if k.lower() not in _HOP_BY_HOP]
    # One request per upstream connection: a second request on a kept-alive client
    # connection could name another host.
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Proxy:
    """Both listeners' connection handlers over one ``Decider``."""

    def __init__(self, decider: Decider) -> None:
        self._decider = decider

    async def handle_proxy(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One client of the explicit proxy."""
        try:
            head, rest = await _read_head(reader)
        except (TimeoutError, OSError):
            writer.close()
            return
        if head is None:
            await self._answer(writer, _refusal(400, "bad_request"))
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
            await self._answer(writer, _refusal(400, "bad_request"))
            return
        host, port = target
        decision = await self._decider.by_host(host, port, transport=transport)
        if not decision.allowed:
            await self._answer(writer, _refusal(403, decision.reason.value))
            return
        upstream = await _open(decision.addresses, port)
        if upstream is None:
            await self._answer(writer, _refusal(502, "connect_failed"))
            return
        if head.method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            upstream[1].write(_origin_request(head, path))
        if rest:
            upstream[1].write(rest)
        await _splice((reader, writer), upstream)

    async def _answer(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        with contextlib.suppress(OSError):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def handle_transparent(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One redirected TCP connection of the sandbox."""
        sock = writer.get_extra_info("socket")
        try:
            address, port = original_destination(sock)
        except OSError:
            _reset(writer)
            return
        decider = self._decider
        first = b""
        decision = self._by_destination(address, port)
        recorded = decision.allowed
        sniff = (
            not decision.allowed
            and decision.reason is not EgressReason.REFUSED_ADDRESS
            and decider.names_matter
        )
        if sniff:
            first = await self._sniff(reader)
            name = tls_server_name(first) or _host_of(first)
            if name is not None:
                transport: EgressTransport = "tls" if first[:1] == b"\x16" else "http"
                decision = await decider.by_host(name, port, transport=transport)
                recorded = True
        if not decision.allowed:
            if not recorded:
                if decision.reason is EgressReason.NOT_ALLOWED:
                    decision = Decision(False, EgressReason.UNKNOWN_DESTINATION)
                decider.record(decision, transport="tcp", name=None, address=address, port=port)
            _reset(writer)
            return
        upstream = await _open(decision.addresses, port)
        if upstream is None:
            _reset(writer)
            return
        if first:
            upstream[1].write(first)
        await _splice((reader, writer), upstream)

    def _by_destination(self, address: IPAddress, port: int) -> Decision:
        """Allowed as an address, or as the name the resolver handed it out for.

        Refusals are not recorded here: the caller records the final verdict once.
        """
        decider = self._decider
        if not decider.address_ok(address):
            return Decision(False, EgressReason.REFUSED_ADDRESS)
        name = decider.name_for(address)
        verdict = decider.policy.decide(name=name, addresses=[address], port=port)
        if verdict.allowed:
            return decider.record(
                Decision(True, verdict.reason, [address]),
                transport="tcp",
                name=name,
                address=address,
                port=port,
            )
        return Decision(False, verdict.reason)

    async def _sniff(self, reader: asyncio.StreamReader) -> bytes:
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(_SNIFF_TIMEOUT_S):
                return await reader.read(MAX_HEAD_BYTES)
        return b""


def _host_of(first: bytes) -> str | None:
    head = request_head(first)
    host = head.header("host") if head is not None else None
    target = split_host_port(host, 80) if host else None
    return target[0] if target else None


__all__ = ["Proxy", "original_destination"]
