"""How a file name a job chose travels on the wire when it is not plain UTF-8.

A job can name a file with any bytes but NUL and ``/``; JSON carries only Unicode
text. A name (or a symlink target) is sent as is when it is valid UTF-8 and has
no backslash. Otherwise it is sent *escaped*: each byte that is not part of a
valid UTF-8 sequence becomes ``\\xHH`` (two lowercase hex digits) and each
backslash becomes ``\\\\``; everything else stays as it is. So ``b"\\xc3.txt"``
travels as ``"\\\\xc3.txt"`` (the six characters ``\\xc3.txt``).

The mapping is one-to-one with no flag beside it: an escaped name always holds
a backslash and a plain one never does, and ``validate_workspace_path`` refuses
backslashes, so an escaped name is never taken for a path a client can address.
``unescape_name`` gives the bytes back. The golden vectors in
tests/protocol/golden.json (``escaped_name``) pin both directions.
"""

from __future__ import annotations

import re

from .errors import ProtocolError

_ESCAPE_RE = re.compile(r"\\(?:x([0-9a-f]{2})|(\\))")


def escape_name(raw: bytes) -> str:
    """The wire form of a file name or symlink target given as bytes."""
    if b"\\" not in raw:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            pass
    text = raw.decode("utf-8", "surrogateescape")
    out: list[str] = []
    for char in text:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a byte surrogateescape could not decode
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char == "\\":
            out.append("\\\\")
        else:
            out.append(char)
    return "".join(out)


def is_escaped_name(name: str) -> bool:
    """True when ``name`` is in the escaped form (it holds a backslash)."""
    return "\\" in name


def unescape_name(name: str) -> bytes:
    """The bytes a wire name stands for; ``ProtocolError`` for a malformed escape."""
    try:
        return _unescape(name)
    except UnicodeEncodeError:
        raise ProtocolError("name: not valid Unicode text (a lone surrogate)") from None


def _unescape(name: str) -> bytes:
    if not is_escaped_name(name):
        return name.encode("utf-8")
    out = bytearray()
    position = 0
    for match in _ESCAPE_RE.finditer(name):
        literal = name[position : match.start()]
        if "\\" in literal:
            raise ProtocolError("name: malformed escape (only \\xHH and \\\\)")
        out += literal.encode("utf-8")
        out += bytes([int(match.group(1), 16)]) if match.group(1) else b"\\"
        position = match.end()
    tail = name[position:]
    if "\\" in tail:
        raise ProtocolError("name: malformed escape (only \\xHH and \\\\)")
    out += tail.encode("utf-8")
    # Escaping is canonical: a byte that UTF-8 decodes would not have been escaped.
    if escape_name(bytes(out)) != name:
        raise ProtocolError("name: not in canonical escaped form")
    return bytes(out)


__all__ = ["escape_name", "is_escaped_name", "unescape_name"]
