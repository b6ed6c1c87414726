"""One network namespace per session: the jail's own ``localhost``, reachable by the runner.

Every job and process of a session runs in the same namespace (nsjail with
``clone_newnet: false`` after the spawner child ``setns``es into it), so a dev
server started in one call is reachable from the next, while the namespace holds
nothing but ``lo``: no route out, as with a fresh namespace per job.

The namespace lives in a dedicated thread that ``unshare``s into it and stays
there: a socket keeps the namespace it was created in, so the preview proxy asks
that thread for sockets and connects them from the event loop. No thread ever
switches back and forth, so no pooled thread can be left in the wrong namespace.
An open fd to the namespace keeps it alive; ``close`` drops both.

Creating a namespace needs ``CAP_SYS_ADMIN`` (a root runner); without it sessions
fall back to a fresh namespace per job and the preview reports itself unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import queue
import socket
import struct
import threading
from concurrent.futures import Future

log = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = struct.Struct("16sH22x")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class NetnsUnavailableError(OSError):
    """This runner cannot create network namespaces (not root, or no kernel support)."""


_Request = tuple[int, "Future[socket.socket]"] | None


class SessionNetns:
    """A network namespace with ``lo`` up, and a thread inside it that makes sockets."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        ready: Future[int] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="sandcell-netns", daemon=True
        )
        self._thread.start()
        self.fd = ready.result(timeout=10)
        """An open ``/proc/thread-self/ns/net`` of the namespace (for ``setns``)."""
        self._closed = False

    def _run(self, ready: Future[int]) -> None:
        try:
            _unshare_net()
            _loopback_up()
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(fd)
        while (request := self._requests.get()) is not None:
            family, future = request
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(socket.socket(family, socket.SOCK_STREAM))
                except BaseException as exc:
                    future.set_exception(exc)

    def new_socket(self, family: int = socket.AF_INET) -> Future[socket.socket]:
        """A new TCP socket in the namespace (not yet connected)."""
        future: Future[socket.socket] = Future()
        if self._closed:
            future.set_exception(NetnsUnavailableError(errno.ENOENT, "namespace closed"))
        else:
            self._requests.put((family, future))
        return future

    async def connect(self, port: int, *, timeout_s: float = 5) -> socket.socket:
        """A non-blocking socket connected to ``localhost:port`` inside the namespace.

        127.0.0.1 first, then ::1 (servers that bind ``localhost`` may take either);
        ``ConnectionRefusedError`` when nothing listens on either.
        """
        loop = asyncio.get_running_loop()
        last: OSError | None = None
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            sock = await asyncio.wrap_future(self.new_socket(family))
            sock.setblocking(False)
            try:
                async with asyncio.timeout(timeout_s):
                    await loop.sock_connect(sock, (host, port))
            except (OSError, TimeoutError) as exc:
                sock.close()
                last = exc if isinstance(exc, OSError) else TimeoutError("connect timed out")
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        raise last if last is not None else ConnectionRefusedError(errno.ECONNREFUSED, "refused")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the thread and drop the fd; the namespace goes with its last process."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)
        fd, self.fd = self.fd, -1
        with contextlib.suppress(OSError):
            os.close(fd)


def _unshare_net() -> None:
    """Move the calling thread (only it) into a new network namespace."""
    if _libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsUnavailableError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")


def _loopback_up() -> None:
    """``ip link set lo up`` by ioctl: a fresh namespace's ``lo`` starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = _IFREQ.pack(b"lo", 0)
        _, flags = _IFREQ.unpack(fcntl.ioctl(sock, _SIOCGIFFLAGS, request))
        fcntl.ioctl(sock, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))


def create_netns() -> SessionNetns:
    """A new session namespace; ``NetnsUnavailableError`` when this runner cannot."""
    if os.geteuid() != 0:
        raise NetnsUnavailableError(errno.EPERM, "network namespaces need a root runner")
    return SessionNetns()


__all__ = ["NetnsUnavailableError", "SessionNetns", "create_netns"]
