"""``is_ascii_digits``, and the checks of untrusted numbers built on it: a Unicode digit
is refused as a malformed number, never raised from ``int()`` or read as another value."""

from __future__ import annotations

import pytest

from sandcell_orchestrator.e2b.ports import user_port
from sandcell_protocol import is_ascii_digits
from sandcell_runner.egress.sniff import split_host_port

UNICODE_DIGITS = ["\u00b2", "\u0663", "\uff11", "1\u00b2", "\u09ea\u09e6"]
"""Superscript two (``int()`` refuses it), Arabic-Indic three and fullwidth one
(``int()`` reads them), a mix, Bengali forty: each passes ``str.isdigit()``."""


def test_only_ascii_digits_are_digits() -> None:
    assert is_ascii_digits("0")
    assert is_ascii_digits("65535")
    assert is_ascii_digits("123", max_length=3)
    assert not is_ascii_digits("1234", max_length=3)
    for text in ["", "-1", "+1", " 1", "1.0", "0x10", *UNICODE_DIGITS]:
        assert not is_ascii_digits(text), text


@pytest.mark.parametrize("port", UNICODE_DIGITS)
def test_a_port_in_unicode_digits_is_no_port(port: str) -> None:
    # A job's proxy request line (decoded as Latin-1) and an E2B port header.
    assert split_host_port(f"example.com:{port}", 443) is None
    assert user_port(port) is None


def test_ascii_ports_still_parse() -> None:
    assert split_host_port("example.com:8080", 443) == ("example.com", 8080)
    assert split_host_port("example.com", 443) == ("example.com", 443)
    assert user_port("3000") == 3000
    assert user_port("70000") is None
