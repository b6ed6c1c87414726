"""Response headers built from untrusted names (a file's name, as its uploader or a job
gave it)."""

from __future__ import annotations

import urllib.parse

__all__ = ["content_disposition"]

_PLAIN = frozenset(chr(code) for code in range(0x20, 0x7F)) - {'"', "\\"}
"""What a quoted ``filename`` carries as it is: printable ASCII but the quote and backslash."""


def content_disposition(disposition: str, filename: str) -> str:
    """``Content-Disposition`` naming ``filename``, whatever characters it has.

    A header is Latin-1 on the wire and may hold no control characters (a name with
    ``\\n`` or non-Latin-1 characters would fail the response as a 500), so a name that
    is not plain ASCII is sent as RFC 6266's ``filename*`` (UTF-8, percent-encoded),
    after a plain ``filename`` fallback with those characters as ``_``.
    """
    if all(char in _PLAIN for char in filename):
        return f'{disposition}; filename="{filename}"'
    fallback = "".join(char if char in _PLAIN else "_" for char in filename)
    encoded = urllib.parse.quote(filename, safe="")
    return f"{disposition}; filename=\"{fallback}\"; filename*=UTF-8''{encoded}"
