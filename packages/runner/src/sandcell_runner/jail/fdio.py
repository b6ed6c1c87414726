"""Writing to a jailed process's non-blocking stdin from the event loop."""

from __future__ import annotations

import asyncio
import os


async def write_all(fd: int, data: bytes, *, timeout_s: float = 5.0) -> None:
    """Write all of ``data`` to the non-blocking ``fd``, waiting while its pipe is full.

    Raises ``TimeoutError`` when the reader takes nothing for ``timeout_s`` in all
    and ``BrokenPipeError`` when it closed its end; callers name the process.
    """
    view = memoryview(data)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s):
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(fd, writable.set_result, None)
                try:
                    await writable
                finally:
                    loop.remove_writer(fd)
