"""Whether untrusted text is a decimal number ``int()`` reads as written: ASCII digits only.

``str.isdigit()`` is true of superscripts and other Unicode digits (``"²"``), which
``int()`` refuses (a ValueError where a 4xx was meant), and ``str.isdecimal()`` of
Arabic-Indic and other decimal digits, which ``int()`` reads (``"٣"`` is 3), so a
header, a query or a request line decoded as Latin-1 or UTF-8 passed both checks as
something other than what a reader of it sees. Every check of a number that came
from outside goes through here.
"""

from __future__ import annotations

__all__ = ["is_ascii_digits"]


def is_ascii_digits(text: str, *, max_length: int | None = None) -> bool:
    """True for one or more ASCII digits (at most ``max_length`` of them when given)."""
    return text.isascii() and text.isdigit() and (max_length is None or len(text) <= max_length)
