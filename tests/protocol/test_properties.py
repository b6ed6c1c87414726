"""Hypothesis properties of the derivations."""

from __future__ import annotations

import hashlib
import posixpath

from hypothesis import given
from hypothesis import strategies as st

from sandcell_protocol import (
    ProtocolError,
    escape_name,
    input_cache_key,
    is_escaped_name,
    unescape_name,
    validate_workspace_path,
)

nul_free = st.text(
    alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=40,
)


@given(nul_free, nul_free, nul_free, nul_free)
def test_input_cache_key_injective(s1: str, o1: str, s2: str, o2: str) -> None:
    """Distinct NUL-free pairs never share a key."""
    if (s1, o1) != (s2, o2):
        assert input_cache_key(s1, o1) != input_cache_key(s2, o2)
    else:
        assert input_cache_key(s1, o1) == input_cache_key(s2, o2)


@given(nul_free, nul_free)
def test_space_join_never_matches(left: str, right: str) -> None:
    """sha256("a b") never equals the key of the split pair ("a", "b")."""
    space_joined = hashlib.sha256(f"{left} {right}".encode()).hexdigest()
    assert input_cache_key(left, right) != space_joined


path_alphabet = st.sampled_from(["a", "b", ".", "/", "..", "\\", "\x00", "é", " ", "-", "x" * 60])


@given(st.lists(path_alphabet, max_size=12).map("".join) | st.text(max_size=60))
def test_workspace_path_never_escapes(raw: str) -> None:
    """Whatever comes in, what comes out is relative, ``..``-free and idempotent."""
    try:
        normalized = validate_workspace_path(raw)
    except ProtocolError:
        return
    assert not normalized.startswith("/")
    assert ".." not in normalized.split("/")
    assert "\x00" not in normalized
    assert posixpath.normpath(posixpath.join("/ws", normalized)).startswith("/ws/")
    assert validate_workspace_path(normalized) == normalized


name_bytes = st.binary(min_size=1, max_size=40) | st.lists(
    st.sampled_from([b"a", b"\\", b"x", b"\xc3", b"\xa9", b"\xff", b"\\x41", "é".encode()]),
    min_size=1,
    max_size=12,
).map(b"".join)


@given(name_bytes, name_bytes)
def test_escaped_names_round_trip_and_never_collide(first: bytes, second: bytes) -> None:
    """Any bytes escape to text that unescapes to them; distinct bytes, distinct names."""
    wire = escape_name(first)
    wire.encode("utf-8")  # always JSON-able text
    assert unescape_name(wire) == first
    assert (escape_name(second) == wire) == (first == second)
    assert is_escaped_name(wire) != _plain_utf8(first)


def _plain_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\\" not in raw
