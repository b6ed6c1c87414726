"""Encode and decode wire values; every failure is a ``ProtocolError`` naming the field."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from .errors import ERROR_SEMANTICS, ErrorCode, ProtocolError
from .messages import ErrorBody, ErrorDetail, StreamEvent

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_stream_decoder = msgspec.json.Decoder(StreamEvent)


def encode(value: Any) -> bytes:
    """Encode a message (or list of messages) as compact JSON."""
    try:
        return _encoder.encode(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"encode: {exc}") from exc


def decode(data: bytes | str, type_: type[T]) -> T:
    """Decode JSON into ``type_`` strictly (unknown fields, bad enums, wrong types fail)."""
    try:
        return msgspec.json.decode(data, type=type_, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{_name_of(type_)}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"{_name_of(type_)}: malformed JSON: {exc}") from exc


def _name_of(type_: object) -> str:
    # A union (``A | B``) or a generic alias has no ``__name__``: the error message
    # must not turn a caller's bad input into an AttributeError (a 500).
    return getattr(type_, "__name__", None) or repr(type_)


def encode_event(event: StreamEvent) -> bytes:
    """One NDJSON line of an execute stream."""
    return encode(event) + b"\n"


def decode_event(line: bytes | str) -> StreamEvent:
    """Decode one NDJSON line of an execute stream."""
    try:
        return _stream_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"StreamEvent: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"StreamEvent: malformed JSON: {exc}") from exc


def error_body(code: ErrorCode, message: str, *, retryable: bool | None = None) -> ErrorBody:
    """Build an ``ErrorBody``; ``retryable`` defaults to the code's own semantics."""
    if retryable is None:
        retryable = ERROR_SEMANTICS[code].retryable
    return ErrorBody(error=ErrorDetail(code=code, message=message, retryable=retryable))
