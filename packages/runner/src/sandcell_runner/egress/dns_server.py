"""The sandbox's DNS resolver: answers only names the policy allows, only with safe addresses.

A refused name gets ``NXDOMAIN`` at once (with an Extended DNS Error "prohibited"
naming the reason, when the query speaks EDNS); an allowed name gets the A records the gateway's own
upstream gave, minus every always-refused address (a name that answers
``10.0.0.5`` or ``127.0.0.1`` is refused: no DNS rebinding into the runner's
networks). ``AAAA`` and other types of an allowed name answer empty: the sandbox
link is IPv4 only. Served over UDP and TCP (length-prefixed) alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import cast

import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from sandcell_protocol.egress import EgressReason

from .decide import Decider

log = logging.getLogger(__name__)

_TTL_S = 30
_TCP_IDLE_S = 10.0


async def answer(decider: Decider, wire: bytes) -> bytes | None:
    """The response to one query in wire format (None: not a query worth answering)."""
    try:
        query = dns.message.from_wire(wire)
    except (dns.exception.DNSException, ValueError):
        return None
    if query.flags & dns.flags.QR:
        return None
    response = dns.message.make_response(query)
    response.flags |= dns.flags.RA
    if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
        response.set_rcode(dns.rcode.NOTIMP)
        return response.to_wire()
    question = query.question[0]
    name = question.name.to_text(omit_final_dot=True)
    if question.rdclass != dns.rdataclass.IN:
        response.set_rcode(dns.rcode.REFUSED)
        return response.to_wire()
    reason, addresses = await decider.answer_a(name)
    if reason is not EgressReason.ALLOWED:
        # NXDOMAIN, not REFUSED: stub resolvers retry every server and attempt on
        # REFUSED, but give up at once on a name that does not exist.
        response.set_rcode(dns.rcode.NXDOMAIN)
        if query.edns >= 0:
            response.use_edns(0, options=[dns.edns.EDEOption(dns.edns.EDECode.PROHIBITED, reason)])
    elif question.rdtype == dns.rdatatype.A:
        rrset = dns.rrset.from_text_list(
            question.name, _TTL_S, dns.rdataclass.IN, dns.rdatatype.A, [str(a) for a in addresses]
        )
        response.answer.append(rrset)
    return response.to_wire()


class _UdpResolver(asyncio.DatagramProtocol):
    def __init__(self, decider: Decider) -> None:
        self._decider = decider
        self._transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(self._tasks) > 256:
            return  # a flood: drop, as a busy resolver would
        task = asyncio.ensure_future(self._reply(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = await answer(self._decider, data)
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)


async def _serve_tcp(
    decider: Decider, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
        while True:
            async with asyncio.timeout(_TCP_IDLE_S):
                (size,) = struct.unpack("!H", await reader.readexactly(2))
                wire = await reader.readexactly(size)
            reply = await answer(decider, wire)
            if reply is None:
                break
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    writer.close()


async def serve(decider: Decider, *, udp: socket.socket, tcp: socket.socket) -> asyncio.Server:
    """Answer on the inherited sockets until the loop stops."""
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(lambda: _UdpResolver(decider), sock=udp)
    return await asyncio.start_server(
        lambda r, w: _serve_tcp(decider, r, w), sock=tcp, start_serving=True
    )


__all__ = ["answer", "serve"]
