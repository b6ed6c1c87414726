"""Signed file URLs: ``GET``/``POST /files`` authorised by a ``signature`` query parameter.

The SDK's ``download_url`` and ``upload_url`` hand out a URL a plain HTTP client can
fetch without the envd token::

    /files?path=<p>&username=<u>&signature=v1_<s>&signature_expiration=<unix s>

where ``<s>`` is the unpadded standard base64 of the SHA-256 of
``"<p>:<operation>:<u>:<envdAccessToken>"`` (``":<unix s>"`` appended when the URL
expires). As E2B's envd checks one:

- ``GET`` needs a ``read`` signature, ``POST`` a ``write`` one;
- ``<p>`` is the ``path`` parameter as sent, before it is resolved; an absent
  ``username`` is signed as ``""`` (the default user);
- a request that carries ``X-Access-Token`` is decided by the token alone;
- the signature is compared first, the expiration after it: one in the past (the
  second before now still counts) is refused, but only once the signature matched.

Where they differ (docs/e2b.md): a signature that does not match answers as a wrong
token does, E2B's proxy's 502 for a missing sandbox (a probe learns nothing about
which ids exist), and a signed URL must name its ``path``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..registry import E2bSandboxRow
from .errors import E2bError

__all__ = [
    "ACCESS_LOG_SECRET_PARAMETERS",
    "FileSignature",
    "file_signature",
    "file_signature_ok",
    "sign_file",
]

ACCESS_LOG_SECRET_PARAMETERS = ("signature",)
"""Query parameters the access log must not keep: a signed URL is a credential for as
long as it lives (serve/redaction.py redacts them)."""

_OPERATIONS = {"GET": "read", "POST": "write"}
_EXPIRATION_RE = re.compile(r"[+-]?[0-9]{1,19}")
_INT64 = range(-(2**63), 2**63)
# Signed for when there is no sandbox: the same work either way.
_NO_TOKEN = "x" * 43


@dataclass(frozen=True, kw_only=True)
class FileSignature:
    """What a signed ``/files`` request claims: the signature and what it covers (its
    ``repr`` leaves the signature out: a signed URL is a credential while it lives)."""

    path: str
    operation: str
    username: str
    signature: str = field(repr=False)
    expiration_s: int | None


def file_signature(method: str, query: Mapping[str, str]) -> FileSignature | None:
    """The signature a ``/files`` request carries, or None when it carries none (or its
    method takes none); a malformed one is a 400 (it could never match)."""
    signature = query.get("signature")
    operation = _OPERATIONS.get(method)
    if signature is None or operation is None:
        return None
    path = query.get("path") or ""
    if not path:
        # envd lets an upload signed for no path write wherever its part names say; a
        # signature here covers one path.
        raise E2bError(400, "bad_request", "path: the query parameter is required")
    raw_expiration = query.get("signature_expiration")
    expiration_s = None
    if raw_expiration is not None:
        if _EXPIRATION_RE.fullmatch(raw_expiration) is None:
            raise E2bError(400, "bad_request", "signature_expiration: not an integer")
        expiration_s = int(raw_expiration)
        if expiration_s not in _INT64:
            raise E2bError(400, "bad_request", "signature_expiration: out of range")
    return FileSignature(
        path=path,
        operation=operation,
        username=query.get("username") or "",
        signature=signature,
        expiration_s=expiration_s,
    )


def sign_file(
    *, path: str, operation: str, username: str, token: str, expiration_s: int | None
) -> str:
    """The ``v1_`` signature of ``operation`` on ``path`` as ``username``, by ``token``."""
    parts = [path, operation, username, token]
    if expiration_s is not None:
        parts.append(str(expiration_s))
    digest = hashlib.sha256(":".join(parts).encode()).digest()
    return "v1_" + base64.b64encode(digest).decode("ascii").rstrip("=")


def file_signature_ok(row: E2bSandboxRow | None, signed: FileSignature, *, now_s: float) -> bool:
    """Whether ``signed`` was made with ``row``'s envd access token (compared in constant
    time whether or not there is a row); a matching one that has expired is a 401, as
    envd answers it (its holder was given the URL: nothing is learnt from it)."""
    expected = sign_file(
        path=signed.path,
        operation=signed.operation,
        username=signed.username,
        token=row.access_token if row is not None else _NO_TOKEN,
        expiration_s=signed.expiration_s,
    )
    ok = hmac.compare_digest(expected.encode(), signed.signature.encode())
    if not ok or row is None:
        return False
    if signed.expiration_s is not None and signed.expiration_s < int(now_s):
        raise E2bError(401, "unauthorized", "signature is already expired")
    return True
