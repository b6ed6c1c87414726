"""The driver's side of the runner's pipes: frames in and out, and the cell's output.

``Channel`` reads command frames from fd 0's copy and writes event frames to fd
1's, one writer at a time; ``FrameStream`` is ``sys.stdout``/``sys.stderr`` as
frames; ``FdForwarder`` forwards what subprocesses and C code write to fds 1
and 2. ``Interrupts`` holds a SIGINT back while a frame is being written.
"""

from __future__ import annotations

import io
import json
import os
import select
import struct
import threading
import types
from typing import Any

__all__ = ["Channel", "FdForwarder", "FrameStream", "Interrupts"]

_HEADER = struct.Struct(">I")


class Interrupts:
    """Whether a SIGINT may raise now, and one that arrived while it could not."""

    def __init__(self) -> None:
        self.allowed = False
        self.pending = False

    def handler(self, signum: int, frame: types.FrameType | None) -> None:
        if self.allowed:
            raise KeyboardInterrupt
        self.pending = True

    def reopen(self) -> None:
        """Allow interrupts again, raising one that came in meanwhile."""
        self.allowed = True
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


class Channel:
    """Frames in from the runner, frames out to it (one writer at a time)."""

    def __init__(self, cmd_fd: int, evt_fd: int, interrupts: Interrupts) -> None:
        self._cmd = cmd_fd
        self._evt = evt_fd
        self._interrupts = interrupts
        self.lock = threading.RLock()
        self.forwarder: FdForwarder | None = None

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, ensure_ascii=False, default=str).encode("utf-8", "replace")
        frame = _HEADER.pack(len(data)) + data
        with self.lock:
            allowed = self._interrupts.allowed
            self._interrupts.allowed = False
            try:
                view = memoryview(frame)
                while view:
                    view = view[os.write(self._evt, view) :]
            finally:
                if allowed and threading.current_thread() is threading.main_thread():
                    self._interrupts.reopen()
                elif allowed:
                    self._interrupts.allowed = True

    def _read_exact(self, size: int) -> bytes | None:
        chunks: list[bytes] = []
        while size:
            chunk = os.read(self._cmd, min(size, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def receive(self) -> dict[str, Any] | None:
        header = self._read_exact(_HEADER.size)
        if header is None:
            return None
        body = self._read_exact(_HEADER.unpack(header)[0])
        if body is None:
            return None
        message: dict[str, Any] = json.loads(body)
        return message


class FrameStream(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr``: text as frames, a line at a time."""

    def __init__(self, channel: Channel, name: str, fd: int) -> None:
        self._channel = channel
        self._name = name
        self._fd = fd
        self._parts: list[str] = []
        self._size = 0

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._parts.append(text)
        self._size += len(text)
        if "\n" in text or self._size > 8192:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self._parts:
            text = "".join(self._parts)
            self._parts.clear()
            self._size = 0
            with self._channel.lock:
                # What a finished subprocess wrote comes first, as it did on a terminal.
                if self._channel.forwarder is not None:
                    self._channel.forwarder.drain()
                self._channel.send({"t": self._name, "data": text})


class FdForwarder:
    """Output written to fds 1 and 2 (subprocesses, C code) forwarded as frames."""

    def __init__(self, channel: Channel, fds: dict[int, str]) -> None:
        self._channel = channel
        self._fds = fds
        for fd in fds:
            os.set_blocking(fd, False)
        threading.Thread(target=self._loop, name="sandcell-fds", daemon=True).start()

    def _loop(self) -> None:
        fds = list(self._fds)
        while fds:
            ready, _, _ = select.select(fds, [], [])
            for fd in ready:
                if not self._read(fd):
                    fds.remove(fd)

    def _read(self, fd: int) -> bool:
        with self._channel.lock:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if data:
                self._channel.send({"t": self._fds[fd], "data": data.decode("utf-8", "replace")})
            return bool(data)

    def drain(self) -> None:
        """Forward whatever is waiting (before a run's end is sent)."""
        with self._channel.lock:
            for fd, name in self._fds.items():
                while True:
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    if not data:
                        break
                    self._channel.send({"t": name, "data": data.decode("utf-8", "replace")})
