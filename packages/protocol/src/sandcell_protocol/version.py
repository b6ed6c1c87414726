"""The protocol version and the compatibility rule between peers."""

from __future__ import annotations

import re

from .errors import ProtocolError, ProtocolMismatchError

PROTOCOL_VERSION = "1.3"
"""Majors must match between peers; minors only add.

1.1: code contexts. 1.2: ``egress_refused`` / ``egress_omitted`` execute stream events,
sent only to a peer that announced 1.2 or later (``speaks_at_least``). 1.3: the runner's
limits in its ``Health`` (``limits``), likewise only to a 1.3 peer; the
``method_not_allowed`` error code.
"""

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


def speaks_at_least(peer: str | None, minimum: str) -> bool:
    """Whether a peer that announced ``peer`` (its ``X-Sandcell-Protocol``; None: it sent
    none) understands what ``minimum`` added: same major, minor at least as high.

    What a side asks before it sends a peer anything a later minor added (a new stream
    event): a peer decodes strictly, so an event it does not know would fail its whole
    stream. A malformed or missing version understands nothing new.
    """
    if peer is None:
        return False
    try:
        peer_major, peer_minor = parse_version(peer)
    except ProtocolError:
        return False
    major, minor = parse_version(minimum)
    return peer_major == major and peer_minor >= minor
