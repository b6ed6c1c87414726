"""Moving a decided connection's bytes: on the event loop while it is short, then in the
kernel.

A connection starts on the gateway's event loop (``LoopRelay``): each direction's
bytes are read and written by a reader callback, with no thread and no pipe
between them. Most connections a sandbox makes are short (a TLS handshake, a
small API answer): they end there, and their set-up never waits for a thread to
wake. Once a connection has moved ``bulk_bytes`` in all, or a write would block
(the reader is slower than the writer: a transfer), it is handed to two threads
that move the rest with ``splice(2)`` through a pipe, in the kernel, the GIL
released (``relay``): bulk throughput never passes through Python.

``bulk_bytes`` 0 hands every connection to the threads at once (what the gateway
did before; ``scripts/bench_egress.py`` measures both side by side).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import os
import socket
import threading
from collections.abc import Callable

MAX_CONNECTIONS = 256
"""Relayed connections one gateway (one sandbox) holds at once; past it, new ones are reset."""
BULK_BYTES = 64 * 1024
"""What a connection moves on the event loop before the threads take it (the default)."""
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20
_CHUNK = 64 * 1024

# Two threads per relayed connection, kept for the next one (starting threads is
# a measurable part of a connection's set-up); ``MAX_CONNECTIONS`` bounds the need.
_RELAYS = concurrent.futures.ThreadPoolExecutor(
    max_workers=2 * MAX_CONNECTIONS, thread_name_prefix="sandcell-egress-relay"
)


class _Pipes(threading.local):
    """Each relay thread's splice pipe, kept for its next connection while empty (four
    system calls less per direction of every connection)."""

    pipe: tuple[int, int] | None = None

    def take(self) -> tuple[int, int]:
        pipe, self.pipe = self.pipe, None
        if pipe is None:
            pipe = os.pipe()
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe[1], _F_SETPIPE_SZ, _PIPE_BYTES)
        return pipe


_PIPES = _Pipes()


def _pump(
    src: socket.socket, dst: socket.socket, finished: Callable[[], None], prelude: bytes
) -> None:
    """Send ``prelude`` to ``dst``, then move bytes ``src`` -> ``dst`` in the kernel
    (splice through a pipe) until EOF."""
    pipe_r, pipe_w = pipe = _PIPES.take()
    try:
        if prelude:
            dst.sendall(prelude)
        while moved := os.splice(src.fileno(), pipe_w, _PIPE_BYTES):
            while moved > 0:
                moved -= os.splice(pipe_r, dst.fileno(), moved)
        dst.shutdown(socket.SHUT_WR)
        _PIPES.pipe = pipe  # empty: every byte spliced in was spliced out
    except OSError:
        # A reset or a closed peer: end both directions. The pipe may hold bytes.
        _shut(src, dst)
        os.close(pipe_r)
        os.close(pipe_w)
    finally:
        finished()


def _shut(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _ender(
    client: socket.socket, upstream: socket.socket, done: Callable[[], None]
) -> Callable[[], None]:
    """What each of the two directions calls when it ends: the last closes both."""
    left = [2]
    lock = threading.Lock()

    def finished() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            client.close()
            upstream.close()
            done()

    return finished


def relay(
    client: socket.socket,
    upstream: socket.socket,
    *,
    done: Callable[[], None],
    to_upstream: bytes = b"",
    to_client: bytes = b"",
) -> None:
    """Relay both directions on two threads (the GIL is released in ``splice``); both
    sockets are closed, and ``done`` called, when both directions have ended.

    ``to_upstream`` (bytes the gateway already read from the client) goes first, sent by
    the thread of that direction; ``to_client`` (the proxy's ``200``) is sent here.
    The client-to-upstream thread starts before that answer goes out, so it already
    waits in ``splice`` when the answered client sends its first bytes (a TLS hello):
    answering first and starting it then put a thread's start on every connection's
    set-up path. The other direction starts only after the answer (a server that
    speaks first must not get its bytes to the client before it)."""
    for sock in (client, upstream):
        sock.setblocking(True)
    finished = _ender(client, upstream, done)
    _RELAYS.submit(_pump, client, upstream, finished, to_upstream)
    try:
        if to_client:
            client.sendall(to_client)  # a few bytes to a fresh socket: does not block
    except OSError:
        _shut(client, upstream)
        finished()
        return
    _RELAYS.submit(_pump, upstream, client, finished, b"")


class LoopRelay:
    """One connection relayed by the event loop until it turns out bulk; see the module
    docstring. Starts at once; ``done`` is called once both sockets are closed."""

    def __init__(
        self,
        client: socket.socket,
        upstream: socket.socket,
        *,
        done: Callable[[], None],
        to_upstream: bytes = b"",
        to_client: bytes = b"",
        bulk_bytes: int = BULK_BYTES,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._client = client
        self._upstream = upstream
        self._done = done
        self._bulk_bytes = bulk_bytes
        self._moved = 0
        self._reading: set[socket.socket] = set()
        """The sources the loop watches."""
        self._at_eof: set[socket.socket] = set()
        self._ended = False
        # The answer first (a server that speaks first must not overtake it), then what
        # the client sent with its request; both are small, to fresh sockets.
        pending = {client: to_client, upstream: to_upstream}
        for dst, data in pending.items():
            if data:
                try:
                    pending[dst] = data[dst.send(data) :]
                except BlockingIOError:
                    pass
                except OSError:
                    self._fail()
                    return
        if any(pending.values()):
            self._hand_off(to_upstream=pending[upstream], to_client=pending[client])
            return
        for src, dst in ((client, upstream), (upstream, client)):
            self._loop.add_reader(src.fileno(), self._move, src, dst)
            self._reading.add(src)

    def _move(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            data = src.recv(_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            self._fail()
            return
        if not data:
            self._stop_reading(src)
            self._at_eof.add(src)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            if len(self._at_eof) == 2:
                self._close()
            return
        try:
            sent = dst.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._fail()
            return
        self._moved += len(data)
        if sent < len(data) or self._moved >= self._bulk_bytes:
            rest = data[sent:]
            to_upstream, to_client = (rest, b"") if dst is self._upstream else (b"", rest)
            self._hand_off(to_upstream=to_upstream, to_client=to_client)

    def _stop_reading(self, sock: socket.socket) -> None:
        if sock in self._reading:
            self._loop.remove_reader(sock.fileno())
            self._reading.discard(sock)

    def _hand_off(self, *, to_upstream: bytes, to_client: bytes) -> None:
        """The rest to two splice threads, each sending its direction's unsent bytes first
        (a direction that already ended on the loop needs no thread)."""
        client, upstream = self._client, self._upstream
        for sock in list(self._reading):
            self._stop_reading(sock)
        self._ended = True
        for sock in (client, upstream):
            sock.setblocking(True)
        finished = _ender(client, upstream, self._done)
        for src, dst, prelude in ((client, upstream, to_upstream), (upstream, client, to_client)):
            if src not in self._at_eof:
                _RELAYS.submit(_pump, src, dst, finished, prelude)
            else:
                finished()

    def _fail(self) -> None:
        _shut(self._client, self._upstream)
        self._close()

    def _close(self) -> None:
        if self._ended:
            return
        self._ended = True
        for sock in list(self._reading):
            self._stop_reading(sock)
        self._client.close()
        self._upstream.close()
        self._done()


__all__ = ["BULK_BYTES", "MAX_CONNECTIONS", "LoopRelay", "relay"]
