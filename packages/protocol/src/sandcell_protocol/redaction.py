"""Tokens out of every diagnostic an agent receives: one rule both sides apply.

A browser error's stack names the page's URL, and a preview URL carries its
access token in the query (``?token=…``); a server log can echo an
``Authorization: Bearer …`` header. The runner applies ``redact_secrets`` to
what it records (runtime errors, process log lines); the orchestrator applies it
again, with the exact secrets it knows (an instance's preview token), to every
diagnostic it answers (runtime errors, logs, analysis, command output, webhooks).

Redacted: the value of a query parameter whose name says it is a credential
(``token``, ``access_token``, ``api_key``, ``signature``, ``X-Amz-Security-Token``,
… any case), a ``Bearer`` credential, and every exact value in ``secrets``. Each
becomes ``[redacted]``; the rest of the text (a stack frame's ``:line:column``)
is kept. The golden vectors (``redacted_text``) pin the rule on both sides.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TypeVar

import msgspec

REDACTED = "[redacted]"

SECRET_QUERY_PARAMETERS = (
    "token",
    "access_token",
    "id_token",
    "refresh_token",
    "auth",
    "api_key",
    "apikey",
    "password",
    "secret",
    "signature",
    "sig",
    "x-amz-signature",
    "x-amz-security-token",
    "x-amz-credential",
)

# A credential's characters: RFC 3986 unreserved, '%' escapes, and base64's '+/='.
# A ':' ends it, so a frame's ``main.js?token=abc:10:5`` keeps its ``:10:5``.
_VALUE = r"[A-Za-z0-9._~%+/=-]+"
_NAMES = "|".join(re.escape(p) for p in SECRET_QUERY_PARAMETERS)
_QUERY_RE = re.compile(r"(?i)((?:^|[?&;\s])(?:" + _NAMES + r")=)" + _VALUE)
_BEARER_RE = re.compile(r"(?i)(\bbearer\s+)" + _VALUE)

M = TypeVar("M", bound=msgspec.Struct)


def redact_secrets(text: str, *, secrets: Iterable[str] = ()) -> str:
    """``text`` with URL credentials, bearer tokens and each of ``secrets`` redacted."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    text = _QUERY_RE.sub(lambda m: m.group(1) + REDACTED, text)
    return _BEARER_RE.sub(lambda m: m.group(1) + REDACTED, text)


def redact_message(message: M, *, secrets: Iterable[str] = ()) -> M:
    """A copy of a wire message with ``redact_secrets`` applied to every string in it."""
    plain = _redact_value(msgspec.to_builtins(message), tuple(secrets))
    return msgspec.convert(plain, type(message))


def _redact_value(value: object, secrets: tuple[str, ...]) -> object:
    if isinstance(value, str):
        return redact_secrets(value, secrets=secrets)
    if isinstance(value, list):
        return [_redact_value(item, secrets) for item in value]
    if isinstance(value, dict):
        return {key: _redact_value(item, secrets) for key, item in value.items()}
    return value


__all__ = ["REDACTED", "SECRET_QUERY_PARAMETERS", "redact_message", "redact_secrets"]
