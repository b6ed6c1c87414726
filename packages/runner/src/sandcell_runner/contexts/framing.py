"""Frames between the runner and a context driver: a 4-byte big-endian length, then JSON.

The driver runs the cell's code, and that code can write to the driver's event
descriptor as well: every frame from it is untrusted. ``FrameReader`` caps a
frame's size and decodes each into a strict ``msgspec`` shape; anything else is a
``FrameError`` and the runner gives the context up.
"""

from __future__ import annotations

import struct
from typing import Any, Literal

import msgspec

_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The driver sent something that is not a valid frame."""


class _Frame(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="t"):
    pass


class Ready(_Frame, frozen=True, tag="ready"):
    version: str = ""
    """The interpreter's version (for logs)."""


class Output(_Frame, frozen=True, tag="stdout"):
    data: str


class ErrorOutput(_Frame, frozen=True, tag="stderr"):
    data: str


class Result(_Frame, frozen=True, tag="result"):
    data: dict[str, Any]
    main: bool = False


class Error(_Frame, frozen=True, tag="error"):
    name: str
    value: str
    traceback: str


class End(_Frame, frozen=True, tag="end"):
    status: Literal["ok", "error"]
    count: int
    cpu_ms: int = 0


Frame = Ready | Output | ErrorOutput | Result | Error | End
_decoder = msgspec.json.Decoder(Frame)
_encoder = msgspec.json.Encoder()


def encode_command(command: dict[str, Any]) -> bytes:
    """One frame to the driver."""
    body = _encoder.encode(command)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into decoded frames; ``max_frame_bytes`` bounds each."""

    def __init__(self, *, max_frame_bytes: int) -> None:
        self._max = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > self._max:
                raise FrameError(f"frame of {size} bytes is over the {self._max}-byte cap")
            end = _HEADER.size + size
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[_HEADER.size : end])
            del self._buffer[:end]
            try:
                frames.append(_decoder.decode(body))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise FrameError(f"invalid frame: {exc}") from None
        return frames

    def pending_text(self) -> str:
        """What is buffered but not a frame (a driver that died printing a traceback)."""
        return bytes(self._buffer[-4000:]).decode("utf-8", "replace")
