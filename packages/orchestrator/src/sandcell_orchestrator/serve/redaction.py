"""Credentials in a request's query string kept out of uvicorn's access log.

Some routes take a credential in the query: a first preview request its
``token`` (apps/preview.py), a signed E2B file URL its ``signature``
(e2b/signing.py). uvicorn's access log records each request's path and query,
so a line would keep the credential for as long as the log is kept. Each
package declares the names of the parameters it reads a credential from; the
server installs one ``RedactQueryParameters`` with all of them on the access
logger, where it builds the app (``serve.app.create_app``).

The rule is the access log's own, narrower than ``sandcell_protocol.redaction``
(which scrubs diagnostics an agent reads): a parameter is named exactly (case
sensitive; ``mytoken=`` is not ``token=``) after ``?``, ``&`` or the start of the
text, and its value up to the next ``&``, whitespace or ``"`` becomes
``[redacted]``. The name is compared as the server reads it, percent-decoded once
(``%73ignature=`` is a ``signature``: the log keeps the query as sent), and a
name is looked for after every ``?`` and ``&``, inside another parameter's value
too.

uvicorn's WebSocket protocol logs on its error logger instead (``uvicorn.error``):
each upgrade's path and query at INFO (``"WebSocket /preview/…?token=…" 403``), and,
through the websockets library it hands that logger to, the request line and every
header (``< cookie: …``, ``< authorization: …``) and each frame at DEBUG. The server
redacts the same parameters there and drops those handshake lines
(``QuietHandshakes``).
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Iterable

__all__ = [
    "ACCESS_LOGGER",
    "ERROR_LOGGER",
    "REDACTED",
    "QuietHandshakes",
    "RedactQueryParameters",
    "quiet_handshakes",
    "redact_access_log",
]

ACCESS_LOGGER = "uvicorn.access"
ERROR_LOGGER = "uvicorn.error"
REDACTED = "[redacted]"

# A parameter's name and its ``=``, where one may start; the name as sent (encoded).
_NAME = re.compile(r'(?:^|(?<=[?&]))([^=&\s"?/]+)=')
_VALUE_END = re.compile(r'[&\s"]')


class RedactQueryParameters(logging.Filter):
    """Replaces the value of each named query parameter in a log record with
    ``[redacted]`` (in its arguments, where uvicorn puts the path, and its message)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        super().__init__()
        self._names: frozenset[str] = frozenset()
        self.add(names)

    def __repr__(self) -> str:
        return f"RedactQueryParameters({sorted(self._names)!r})"

    @property
    def names(self) -> frozenset[str]:
        """The parameters whose values are redacted."""
        return self._names

    def add(self, names: Iterable[str]) -> None:
        """Redact these parameters too (the ones already named stay redacted)."""
        # One assignment: a record filtered meanwhile sees the old names or the new.
        self._names = self._names | frozenset(names)

    @staticmethod
    def _named(raw: str, names: frozenset[str]) -> bool:
        # parse_qsl's reading (Starlette's): '+' is a space, %XX decoded once.
        return raw in names or ("%" in raw and urllib.parse.unquote_plus(raw) in names)

    def redact(self, text: str) -> str:
        """``text`` with each named parameter's value replaced by ``[redacted]``."""
        names = self._names
        if not names or "=" not in text:
            return text
        parts: list[str] = []
        done = 0
        for match in _NAME.finditer(text):
            if match.start() < done or not self._named(match.group(1), names):
                continue  # inside a value already redacted, or another parameter
            end = _VALUE_END.search(text, match.end())
            parts += [text[done : match.end()], REDACTED]
            done = len(text) if end is None else end.start()
        if not parts:
            return text
        parts.append(text[done:])
        return "".join(parts)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                self.redact(arg) if isinstance(arg, str) else arg for arg in record.args
            )
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        return True


def redact_access_log(
    names: Iterable[str], logger_name: str = ACCESS_LOGGER
) -> RedactQueryParameters:
    """Redact ``names`` on ``logger_name``: one filter per logger, however often it is
    called (each app built in a process adds its names to the one already there)."""
    logger = logging.getLogger(logger_name)
    for item in logger.filters:
        if isinstance(item, RedactQueryParameters):
            item.add(names)
            return item
    installed = RedactQueryParameters(names)
    logger.addFilter(installed)
    return installed


class QuietHandshakes(logging.Filter):
    """Drops the lines websockets logs as ``< …`` / ``> …`` (a handshake's request and
    response lines, each header, each frame): they carry a client's credentials."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(("< ", "> ")))


def quiet_handshakes(logger_name: str = ERROR_LOGGER) -> QuietHandshakes:
    """Install one ``QuietHandshakes`` on ``logger_name`` (however often it is called)."""
    logger = logging.getLogger(logger_name)
    for item in logger.filters:
        if isinstance(item, QuietHandshakes):
            return item
    installed = QuietHandshakes()
    logger.addFilter(installed)
    return installed
