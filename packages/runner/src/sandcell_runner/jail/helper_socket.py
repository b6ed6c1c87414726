"""The runner's end of a resident helper's socket: numbered requests out, answers in.

Two helpers live beside the runner and start children for it: the spawn helper
(``spawn_helper.py``, jobs) and the extractor fork server
(``checkpoint/extractor_process.py``, restores). Each is reached the same way,
and the parts that keep that safe live here:

- ``helper_socketpair``: a ``SOCK_SEQPACKET`` pair for the launch; the helper's
  end is closed once it has it, ours too when the launch fails;
- ``PendingRequests``: numbered requests, each a datagram carrying descriptors,
  answered by number; a caller cancelled while it waits still gets its child
  started by the helper, so that child is killed the moment the answer names it;
  a lost helper fails every waiter;
- ``stop_reading``: the socket leaves the loop and is closed.

What a request and an answer say (marshal or msgspec, which ops) stays with each.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def helper_socketpair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(ours, the helper's) for launching a helper: ``with`` it around the launch.

    On leaving, the helper's end is closed (the child holds its own copy); when the
    launch raised, ours is closed too.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        yield ours, theirs
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()


class PendingRequests(Generic[T]):
    """Requests sent to a helper and not answered yet, by request number."""

    def __init__(self) -> None:
        self._seq = 0
        self._futures: dict[int, asyncio.Future[T]] = {}

    def next_seq(self) -> int:
        """The next request number (also for requests that get no future here)."""
        self._seq += 1
        return self._seq

    async def send(
        self,
        sock: socket.socket,
        seq: int,
        data: bytes,
        fds: Sequence[int],
        *,
        unreachable: Callable[[OSError], BaseException],
        kill_when_answered: Callable[[asyncio.Future[T]], None],
    ) -> T:
        """Send request ``seq`` and wait for its answer.

        ``unreachable``: the error when the send fails. Cancelled while it waits, the
        helper acts on the request anyway: ``kill_when_answered`` gets its answer.
        """
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._futures[seq] = future
        try:
            socket.send_fds(sock, [data], list(fds))
        except OSError as exc:
            self._futures.pop(seq, None)
            raise unreachable(exc) from None
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(kill_when_answered)
            raise

    def pop(self, seq: object) -> asyncio.Future[T] | None:
        """The waiter of request ``seq`` (None for an unknown or malformed number)."""
        return self._futures.pop(seq, None) if isinstance(seq, int) else None

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """The helper is lost: every waiter gets a fresh ``error()``."""
        futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(error())


def stop_reading(sock: socket.socket, loop: asyncio.AbstractEventLoop | None) -> None:
    """Take ``sock`` off ``loop`` (unless the loop is closed already) and close it."""
    if loop is not None and not loop.is_closed():
        loop.remove_reader(sock.fileno())
    sock.close()


__all__ = ["PendingRequests", "helper_socketpair", "stop_reading"]
