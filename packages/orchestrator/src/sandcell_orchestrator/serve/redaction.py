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
``[redacted]``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

__all__ = ["ACCESS_LOGGER", "REDACTED", "RedactQueryParameters", "redact_access_log"]

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "[redacted]"


class RedactQueryParameters(logging.Filter):
    """Replaces the value of each named query parameter in a log record with
    ``[redacted]`` (in its arguments, where uvicorn puts the path, and its message)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        super().__init__()
        self._names: frozenset[str] = frozenset()
        self._pattern: re.Pattern[str] | None = None
        self.add(names)

    def __repr__(self) -> str:
        return f"RedactQueryParameters({sorted(self._names)!r})"

    @property
    def names(self) -> frozenset[str]:
        """The parameters whose values are redacted."""
        return self._names

    def add(self, names: Iterable[str]) -> None:
        """Redact these parameters too (the ones already named stay redacted)."""
        merged = self._names | frozenset(names)
        if merged == self._names:
            return
        alternatives = "|".join(re.escape(name) for name in sorted(merged))
        # One assignment: a record filtered meanwhile sees the old pattern or the new.
        self._pattern = re.compile(r"((?:^|[?&])(?:" + alternatives + r")=)[^&\s\"]*")
        self._names = merged

    def redact(self, text: str) -> str:
        """``text`` with each named parameter's value replaced by ``[redacted]``."""
        pattern = self._pattern
        if pattern is None:
            return text
        return pattern.sub(r"\1" + REDACTED, text)

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
