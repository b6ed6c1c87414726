"""The protocol version and the compatibility rule between peers."""

from __future__ import annotations

import re

from .errors import ProtocolError, ProtocolMismatchError

PROTOCOL_VERSION = "1.1"
"""Majors must match between peers; minors only add."""

_VERSION_RE = re.compile(r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$")


def parse_version(version: str) -> tuple[int, int]:
    """Split ``"MAJOR.MINOR"`` into integers; ``ProtocolError`` if malformed."""
    match = _VERSION_RE.fullmatch(version)
    if match is None:
        raise ProtocolError(f"protocol: {version!r} is not a MAJOR.MINOR version")
    return int(match.group(1)), int(match.group(2))


def check_compatible(peer: str) -> None:
    """Raise ``ProtocolMismatchError`` unless ``peer`` shares our major."""
    try:
        peer_major, _ = parse_version(peer)
    except ProtocolError as exc:
        raise ProtocolMismatchError(ours=PROTOCOL_VERSION, theirs=peer[:32]) from exc
    our_major, _ = parse_version(PROTOCOL_VERSION)
    if peer_major != our_major:
        raise ProtocolMismatchError(ours=PROTOCOL_VERSION, theirs=peer)
