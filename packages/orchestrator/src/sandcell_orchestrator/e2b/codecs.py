"""Connect codecs for the envd apps: a request body that does not decode is a 400.

connectrpc's own codecs let a decoding error out as a bare exception, which its
server answers as ``unknown`` (HTTP 500), logs as a crash and, for some bodies,
follows with a reset connection. These wrap the same codecs and raise
``invalid_argument`` instead, as Connect expects for a malformed request.
"""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError

__all__ = ["strict_codecs"]


class _Strict:
    """``inner``, with a failed decode turned into ``invalid_argument``."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"{message_class.__name__}: malformed request body"
            ) from None


def strict_codecs() -> list[Codec[Any, Any]]:
    """Connect's default codecs (binary and JSON protobuf), strict about bad bodies."""
    return [_Strict(proto_binary_codec()), _Strict(proto_json_codec())]
