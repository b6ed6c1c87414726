"""What a connection's first bytes say about where it is going: TLS SNI or an HTTP ``Host``.

Read-only parsing of untrusted bytes: every length is checked against the
buffer, and anything unexpected answers None (the caller refuses).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sandcell_protocol.digits import is_ascii_digits

_HOST_RE = re.compile(rb"^[A-Za-z0-9.-]{1,253}$")
MAX_HEAD_BYTES = 16 * 1024


def tls_server_name(data: bytes) -> str | None:
    """The SNI host name of a TLS ClientHello at the start of ``data`` (one record)."""
    # record: type(1)=22 version(2) length(2); handshake: type(1)=1 length(3)
    if len(data) < 9 or data[0] != 22 or data[5] != 1:
        return None
    end = min(len(data), 5 + int.from_bytes(data[3:5], "big"))
    pos = 9 + 2 + 32  # client_version, random
    if pos >= end:
        return None
    pos += 1 + data[pos]  # session id
    if pos + 2 > end:
        return None
    pos += 2 + int.from_bytes(data[pos : pos + 2], "big")  # cipher suites
    if pos >= end:
        return None
    pos += 1 + data[pos]  # compression methods
    if pos + 2 > end:
        return None
    ext_end = min(end, pos + 2 + int.from_bytes(data[pos : pos + 2], "big"))
    pos += 2
    while pos + 4 <= ext_end:
        ext_type = int.from_bytes(data[pos : pos + 2], "big")
        ext_len = int.from_bytes(data[pos + 2 : pos + 4], "big")
        pos += 4
        if ext_type == 0:  # server_name: list length(2), type(1)=0 host, length(2), name
            body = data[pos : min(pos + ext_len, ext_end)]
            if len(body) < 5 or body[2] != 0:
                return None
            size = int.from_bytes(body[3:5], "big")
            name = body[5 : 5 + size]
            if len(name) != size or not _HOST_RE.match(name):
                return None
            return name.decode("ascii").rstrip(".").lower()
        pos += ext_len
    return None


@dataclass(frozen=True, slots=True)
class RequestHead:
    """The parsed head of an HTTP/1.x request (all a proxy needs to decide and forward)."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    size: int
    """Bytes of the head, up to and including the blank line."""

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((v for k, v in self.headers if k.lower() == lowered), None)


def request_head(data: bytes) -> RequestHead | None:
    """The request head at the start of ``data`` if complete and well formed, else None."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
        return None
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return None
        headers.append((name, value.strip()))
    return RequestHead(parts[0].upper(), parts[1], parts[2], headers, end + 4)


def split_host_port(authority: str, default_port: int) -> tuple[str, int] | None:
    """``host[:port]`` or ``[v6][:port]`` as (host, port); None when malformed."""
    host, port_text = authority, ""
    if authority.startswith("["):
        close = authority.find("]")
        if close < 0:
            return None
        host, rest = authority[1:close], authority[close + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:]
    elif authority.count(":") == 1:
        host, port_text = authority.split(":")
    if not host:
        return None
    if not port_text:
        return host, default_port
    if not is_ascii_digits(port_text, max_length=5) or not 0 < int(port_text) < 65536:
        return None
    return host, int(port_text)


__all__ = ["MAX_HEAD_BYTES", "RequestHead", "request_head", "split_host_port", "tls_server_name"]
