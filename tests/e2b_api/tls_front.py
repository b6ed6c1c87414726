"""A TLS terminator in front of ``sandcell serve``, reached as an HTTP proxy, for the
E2B_DOMAIN form: what wildcard DNS plus Caddy would be in a deployment.

The SDK, given ``proxy=``, asks it to ``CONNECT api.<domain>:443`` or
``CONNECT 49983-<id>.<domain>:443``; it answers 200, speaks TLS with a certificate
for ``<domain>`` and ``*.<domain>`` (from a CA made for the test), and relays the
decrypted bytes to the plain-HTTP service on loopback, ``Host`` untouched. Only
loopback is ever dialled, whatever the client names.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

from tests.fixtures.egress_remote import _mint as mint_certificates


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class _Front:
    def __init__(self, *, domain: str, upstream_port: int, context: ssl.SSLContext) -> None:
        self.domain = domain
        self.upstream_port = upstream_port
        self.context = context

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        host = target.rsplit(":", 1)[0]
        if method != "CONNECT" or not (host == self.domain or host.endswith("." + self.domain)):
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        await writer.drain()
        await writer.start_tls(self.context)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


@contextlib.contextmanager
def tls_front(directory: Path, *, domain: str, upstream_port: int) -> Iterator[tuple[str, Path]]:
    """Run the front in a thread; yields (its proxy URL, the CA certificate to trust)."""
    ca, cert, key = mint_certificates([domain, f"*.{domain}"], directory)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])
    front = _Front(domain=domain, upstream_port=upstream_port, context=context)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, asyncio.Server] = {}

    async def serve() -> None:
        holder["server"] = await asyncio.start_server(front.handle, "127.0.0.1", 0)
        started.set()

    thread = threading.Thread(target=loop.run_forever, name="tls-front", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    assert started.wait(10)
    port = holder["server"].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", ca
    finally:

        async def stop() -> None:
            holder["server"].close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
