"""A session's runtime errors: deduplicated by a stable fingerprint, counted, categorised.

Errors arrive from the injected browser reporter (``RuntimeErrorReport``) and from
process output (``tracescan.py``). The same error raised again (another request,
another page load) must count, not repeat, so the fingerprint leaves out what
varies between occurrences: numbers, hex addresses, timestamps, quoted paths and
ids, and URL query strings (a dev server's ``?t=1712…`` cache busters). Line
numbers of the top frame are left out too, so an edit above the failing line does
not make an old error look new.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sandcell_protocol import redact_secrets
from sandcell_protocol.app_messages import (
    ErrorCategory,
    RuntimeErrorRecord,
    RuntimeErrorReport,
)

MAX_FINGERPRINTS = 500
_MAX_MESSAGE_CHARS = 2000

_TIMESTAMP_RE = re.compile(
    r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"
)
_UUID_RE = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
_HEX_RE = re.compile(r"\b0x[0-9a-fA-F]+\b")
_QUERY_RE = re.compile(r"\?[^\s)'\"]*")
_QUOTED_RE = re.compile(r"(['\"`])([^'\"`\n]{1,300})\1")
_NUMBER_RE = re.compile(r"\b\d+(?:\.\d+)?\b")
_LONG_ID_RE = re.compile(r"\b(?=[A-Za-z0-9_-]*\d)[A-Za-z0-9_-]{16,}\b")

_FRAME_RE = re.compile(r"^\s*(?:at\s+\S.*|[^@\s]*@\S+:\d+(?::\d+)?)\s*$")
_LOCATION_RE = re.compile(r"(?:^|[\s(@])((?:[a-z]+://)?[^\s()@]+?):(\d+)(?::(\d+))?\)?\s*$")
_NETWORK_RE = re.compile(
    r"ECONNREFUSED|ECONNRESET|ENOTFOUND|ETIMEDOUT|EAI_AGAIN|EHOSTUNREACH|ENETUNREACH"
    r"|fetch failed|Failed to fetch|NetworkError|Network request failed|Load failed"
    r"|Connection refused|Connection reset|Name or service not known"
    r"|Temporary failure in name resolution",
    re.IGNORECASE,
)
_NETWORK_TYPES = frozenset(
    {
        "ConnectionError",
        "ConnectionRefusedError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "URLError",
        "HTTPError",
        "gaierror",
        "ConnectError",
        "ReadTimeout",
        "ConnectTimeout",
        "FetchError",
        "AxiosError",
    }
)
_CATEGORY_BY_TYPE: dict[str, ErrorCategory] = {
    "SyntaxError": "syntax",
    "IndentationError": "syntax",
    "TabError": "syntax",
    "ReferenceError": "reference",
    "NameError": "reference",
    "UnboundLocalError": "reference",
    "TypeError": "type",
    "AttributeError": "type",
}


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """One occurrence of an error, before deduplication."""

    type: str
    message: str
    source: str
    file: str | None = None
    line: int | None = None
    column: int | None = None
    top_frame: str | None = None


def normalize(text: str) -> str:
    """``text`` without the parts that vary between occurrences of the same error."""
    text = _TIMESTAMP_RE.sub("<ts>", text)
    text = _UUID_RE.sub("<id>", text)
    text = _HEX_RE.sub("<hex>", text)
    text = _QUERY_RE.sub("", text)
    text = _QUOTED_RE.sub(_quoted, text)
    text = _LONG_ID_RE.sub("<id>", text)
    return _NUMBER_RE.sub("<n>", text).strip()


def _quoted(match: re.Match[str]) -> str:
    quote, inner = match.group(1), match.group(2)
    if "/" in inner or "\\" in inner:
        return f"{quote}<path>{quote}"
    return match.group(0)


def fingerprint(event: ErrorEvent) -> str:
    """sha256 of type, normalized message and normalized top frame."""
    parts = (event.type, normalize(event.message), normalize(event.top_frame or ""))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def categorize(type_name: str, message: str) -> ErrorCategory:
    """Network first: browsers report a failed ``fetch`` as a ``TypeError``."""
    short = type_name.rsplit(".", 1)[-1]
    if short in _NETWORK_TYPES or _NETWORK_RE.search(message) or _NETWORK_RE.search(short):
        return "network"
    return _CATEGORY_BY_TYPE.get(short, "other")


def from_browser(report: RuntimeErrorReport) -> ErrorEvent:
    """An event from the injected script's report.

    ``window.onerror`` names the script, line and column; rejections and
    ``console.error`` only carry a stack, whose first frame then gives them.
    """
    top = first_frame(report.stack) if report.stack else None
    file = _strip_url(report.url) if report.url else None
    line, column = report.line or None, report.column or None
    if line is None and top is not None and (where := frame_location(top)) is not None:
        file, line, column = _strip_url(where[0]), where[1], where[2]
    if top is None and file is not None and line is not None:
        top = f"{file}:{line}:{column or 0}"
    return ErrorEvent(
        type=report.type.strip() or "Error",
        message=report.message[:_MAX_MESSAGE_CHARS],
        source="browser",
        file=file,
        line=line,
        column=column,
        top_frame=top,
    )


def first_frame(stack: str) -> str | None:
    """The first frame of a V8 (``at f (file:1:2)``) or Firefox (``f@file:1:2``) stack."""
    for line in stack.splitlines()[:50]:
        if _FRAME_RE.match(line):
            return line.strip()[:500]
    return None


def frame_location(frame: str) -> tuple[str, int, int | None] | None:
    """(file, line, column) named by a stack frame, if it names one."""
    match = _LOCATION_RE.search(frame)
    if match is None:
        return None
    column = match.group(3)
    return match.group(1), int(match.group(2)), int(column) if column else None


def _strip_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts.path if parts.scheme in ("http", "https") else url.split("?", 1)[0]


def _redacted(event: ErrorEvent) -> ErrorEvent:
    return dataclasses.replace(
        event,
        type=redact_secrets(event.type),
        message=redact_secrets(event.message),
        file=redact_secrets(event.file) if event.file else event.file,
        top_frame=redact_secrets(event.top_frame) if event.top_frame else event.top_frame,
    )


class RuntimeErrorStore:
    """At most ``max_fingerprints`` records; the least recently seen go first."""

    def __init__(
        self,
        *,
        max_fingerprints: int = MAX_FINGERPRINTS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._records: OrderedDict[str, RuntimeErrorRecord] = OrderedDict()
        self._max = max_fingerprints
        self._clock = clock

    def record(self, event: ErrorEvent) -> tuple[RuntimeErrorRecord, bool]:
        """Count ``event``; returns its record and whether its fingerprint is new.

        Credentials in it (a page URL's ``?token=``, a bearer token) are redacted
        before it is kept: every reader of the store is an agent's diagnostic.
        """
        event = _redacted(event)
        now = self._clock()
        key = fingerprint(event)
        known = self._records.pop(key, None)
        if known is not None:
            updated = RuntimeErrorRecord(
                fingerprint=key,
                type=known.type,
                category=known.category,
                message=known.message,
                file=known.file,
                line=known.line,
                column=known.column,
                top_frame=known.top_frame,
                source=known.source,
                count=known.count + 1,
                first_seen_s=known.first_seen_s,
                last_seen_s=now,
            )
            self._records[key] = updated
            return updated, False
        created = RuntimeErrorRecord(
            fingerprint=key,
            type=event.type[:200],
            category=categorize(event.type, event.message),
            message=event.message[:_MAX_MESSAGE_CHARS],
            file=event.file,
            line=event.line,
            column=event.column,
            top_frame=event.top_frame[:500] if event.top_frame else None,
            source=event.source,
            count=1,
            first_seen_s=now,
            last_seen_s=now,
        )
        self._records[key] = created
        while len(self._records) > self._max:
            self._records.popitem(last=False)
        return created, True

    def since(self, since_s: float | None = None) -> list[RuntimeErrorRecord]:
        """Records last seen at or after ``since_s`` (all when None), oldest first."""
        records = sorted(self._records.values(), key=lambda r: r.first_seen_s)
        if since_s is None:
            return records
        return [r for r in records if r.last_seen_s >= since_s]

    def clear(self) -> None:
        self._records.clear()


__all__ = [
    "MAX_FINGERPRINTS",
    "ErrorEvent",
    "RuntimeErrorStore",
    "categorize",
    "fingerprint",
    "first_frame",
    "frame_location",
    "from_browser",
    "normalize",
]
