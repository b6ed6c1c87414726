"""Pulls from the file server (``SANDCELL_FILE_SERVER_URL``): its credentials, its
answers and its errors, as the input cache's pull sees them.

A URL's user info (``http://user:pass@host``) is taken out of it once and sent as
basic auth: httpx logs every request's URL at INFO (``HTTP Request: GET …``), so no
log line, error or repr built from the URL holds the credential.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit, urlunsplit

from sandcell_protocol import FileRef
from sandcell_protocol.digits import is_ascii_digits

from ..errors import InputMissingError, PayloadTooLargeError

if TYPE_CHECKING:
    import httpx

__all__ = ["check_response", "describe", "map_pull_errors", "split_credentials"]


def describe(ref: FileRef) -> str:
    return f"input {ref.storage_session!r}/{ref.object_id!r} (name {ref.name!r})"


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its user info, and that user info as a basic-auth pair."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    bare = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return bare, (unquote(user), unquote(password))


@contextlib.contextmanager
def map_pull_errors(ref: FileRef) -> Iterator[None]:
    # Only the exception's type goes into the message: its text can carry the URL.
    import httpx  # lazily: pulls are rare, and httpx costs ~25 ms of every start-up

    try:
        yield
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
        raise InputMissingError(
            f"{describe(ref)}: pull from the file server failed ({type(exc).__name__})"
        ) from exc


def check_response(ref: FileRef, response: httpx.Response, max_object_bytes: int) -> int | None:
    """Reject an unusable answer; return its Content-Length, if it has one."""
    if response.status_code != 200:
        raise InputMissingError(
            f"{describe(ref)}: file server answered HTTP {response.status_code}"
        )
    # The raw bytes are what gets hashed; an encoded body would be the wrong object.
    if response.headers.get("content-encoding", "identity").lower() != "identity":
        raise InputMissingError(f"{describe(ref)}: file server sent an encoded body")
    length = response.headers.get("content-length")
    if length is None:
        return None
    if not is_ascii_digits(length):
        raise InputMissingError(f"{describe(ref)}: file server sent a bad Content-Length")
    if int(length) > max_object_bytes:
        raise PayloadTooLargeError(
            f"{describe(ref)}: {length} bytes is over the {max_object_bytes} byte cap"
        )
    return int(length)
