"""How much of a runner's answer this side reads, and for how long.

On the Docker and Lambda MicroVM providers the runner lives in the sandbox's own
container or VM: tenant code that took it over can answer anything (a huge JSON
body, a gzip bomb, an endless line, a slow drip). Every answer is therefore read
through one of the two readers here, each with a cap for its kind of answer
(``AnswerCaps``, derived from the runner's own caps) and a budget of time spent
*waiting on the runner* (time a caller spends on a yielded line is not counted).
Past either, ``RunnerAnswerError`` (a ``SandboxUnavailableError``: 503 to the
caller), and the connection is dropped, not drained.

Bytes are counted after content decoding, which is done here (gzip, deflate) at
most ``DECODED_PIECE_BYTES`` at a time, so a compressed answer cannot expand past
its cap in one step as it could in httpx's decoder; other encodings are refused
(the runner compresses none of these answers, and its client asks for none). A
header flood never reaches this module: httpcore refuses a response head past
its own limit (``RemoteProtocolError``, mapped as every transport failure).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from sandcell_protocol import ExecuteRequest, RunnerLimits

from ..errors import AnswerCeilingError, AnswerTooLargeError, RunnerAnswerError

__all__ = [
    "CEILING_ENV",
    "DECODED_PIECE_BYTES",
    "DEFAULT_CAPS",
    "AnswerCaps",
    "PastCeiling",
    "past_ceiling",
    "read_bounded",
    "read_lines",
    "warn_past_ceiling",
]

log = logging.getLogger(__name__)

MIB = 1 << 20
_BODY_ENV = "SANDCELL_RUNNER_MAX_BODY_BYTES"
_TIMEOUT_ENV = "SANDCELL_RUNNER_MAX_TIMEOUT_MS"
_JSON_ESCAPE_FACTOR = 6
"""A control byte of job output is ``\\u00XX`` in JSON: six bytes for one."""
_BASE64_FACTOR = 4 / 3
_ENVELOPE_BYTES = 64 << 10
"""Room for an answer's fixed fields around its variable parts."""
_FILE_ENTRY_BYTES = 1 << 10
"""One output file's name, hash and fields, its content aside."""
DECODED_PIECE_BYTES = 64 << 10
"""The most one step of content decoding yields (a gzip bomb expands by ~1000x)."""


@dataclass(frozen=True, slots=True)
class PastCeiling:
    """One limit a runner states above the ceiling: the variable it was set by, the one
    that raises the ceiling, and both values."""

    runner_env: str
    stated: int
    ceiling_env: str
    ceiling: int

    def __str__(self) -> str:
        return f"{self.runner_env}={self.stated} is above {self.ceiling_env}={self.ceiling}"


@dataclass(frozen=True, slots=True)
class AnswerCaps:
    """The largest answer of each kind a ``RunnerClient`` reads, from the runner's caps.

    The runner-side fields default to the runner's defaults (``sandcell_runner.config``).
    The caps a client is built with are its ceiling: a runner that states its limits
    (``Health.limits``, protocol 1.3) is read by caps that follow them, each at most
    the ceiling's (``following``); one that states none, by the ceiling itself. A
    runner configured above the ceiling needs a higher one: ``sandcell`` reads it from
    ``SANDCELL_ANSWER_*`` (``CEILING_ENV``; ``OrchestratorSettings.answer_caps``).
    """

    stdout_bytes: int = 1 * MIB
    """``SANDCELL_RUNNER_STDOUT_BYTES``: a job's stdout when its request sets none."""
    stderr_bytes: int = 1 * MIB
    """``SANDCELL_RUNNER_STDERR_BYTES``: likewise for stderr."""
    max_stdout_bytes: int = 64 * MIB
    """``SANDCELL_RUNNER_MAX_STDOUT_BYTES``: the most a request may ask for."""
    max_stderr_bytes: int = 64 * MIB
    output_scan_bytes: int = 256 * MIB
    """``SANDCELL_RUNNER_OUTPUT_SCAN_BYTES``: a turn's hashed output bytes, so the most
    its inlined files can hold."""
    max_output_files: int = 1000
    """``SANDCELL_RUNNER_MAX_OUTPUT_FILES``."""
    max_body_bytes: int = 64 * MIB
    """``SANDCELL_RUNNER_MAX_BODY_BYTES``: the largest workspace file the runner serves."""
    answer_bytes: int = 16 * MIB
    """Any other JSON answer (health, egress, processes, logs, metrics, contexts…)."""
    error_bytes: int = 64 << 10
    """An error body: its message is cut to 500 characters anyway."""
    event_line_bytes: int = 1 * MIB
    """One line of a process event stream (the runner reads output 64 KiB at a time)."""
    max_timeout_ms: int = 600_000
    """``SANDCELL_RUNNER_MAX_TIMEOUT_MS``: how long a run that names no time limit may
    take (the read budget of its answer)."""

    def following(self, limits: RunnerLimits) -> AnswerCaps:
        """These caps as a runner that stated ``limits`` needs them, none above these.

        A request's own output limits may reach the runner's maximum, so that, not
        these caps' default, bounds the runner's stated default."""
        max_stdout = min(limits.max_stdout_bytes, self.max_stdout_bytes)
        max_stderr = min(limits.max_stderr_bytes, self.max_stderr_bytes)
        return dataclasses.replace(
            self,
            stdout_bytes=min(limits.stdout_bytes, max_stdout),
            stderr_bytes=min(limits.stderr_bytes, max_stderr),
            max_stdout_bytes=max_stdout,
            max_stderr_bytes=max_stderr,
            output_scan_bytes=min(limits.output_scan_bytes, self.output_scan_bytes),
            max_output_files=min(limits.max_output_files, self.max_output_files),
            max_body_bytes=min(limits.max_body_bytes, self.max_body_bytes),
            max_timeout_ms=min(limits.max_timeout_ms, self.max_timeout_ms),
        )

    def beyond(self, limits: RunnerLimits) -> tuple[PastCeiling, ...]:
        """The stated ``limits`` these caps, as a ceiling, hold lower; () if none."""
        past: list[PastCeiling] = []
        for name, stated, ceiling, field_name in (
            ("STDOUT_BYTES", limits.stdout_bytes, self.max_stdout_bytes, "max_stdout_bytes"),
            ("STDERR_BYTES", limits.stderr_bytes, self.max_stderr_bytes, "max_stderr_bytes"),
            (
                "MAX_STDOUT_BYTES",
                limits.max_stdout_bytes,
                self.max_stdout_bytes,
                "max_stdout_bytes",
            ),
            (
                "MAX_STDERR_BYTES",
                limits.max_stderr_bytes,
                self.max_stderr_bytes,
                "max_stderr_bytes",
            ),
            (
                "OUTPUT_SCAN_BYTES",
                limits.output_scan_bytes,
                self.output_scan_bytes,
                "output_scan_bytes",
            ),
            (
                "MAX_OUTPUT_FILES",
                limits.max_output_files,
                self.max_output_files,
                "max_output_files",
            ),
            ("MAX_BODY_BYTES", limits.max_body_bytes, self.max_body_bytes, "max_body_bytes"),
            ("MAX_TIMEOUT_MS", limits.max_timeout_ms, self.max_timeout_ms, "max_timeout_ms"),
        ):
            if stated > ceiling:
                past.append(
                    PastCeiling(f"SANDCELL_RUNNER_{name}", stated, CEILING_ENV[field_name], ceiling)
                )
        return tuple(past)

    def execute_bytes(self, request: ExecuteRequest | None = None) -> int:
        """One ``ExecuteResult`` (the object, or the result line of a stream)."""
        limits = request.limits if request is not None else None
        stdout = min((limits and limits.stdout_bytes) or self.stdout_bytes, self.max_stdout_bytes)
        stderr = min((limits and limits.stderr_bytes) or self.stderr_bytes, self.max_stderr_bytes)
        files = int(self.output_scan_bytes * _BASE64_FACTOR)
        return (
            _ENVELOPE_BYTES
            + _JSON_ESCAPE_FACTOR * (stdout + stderr)
            + files
            + self.max_output_files * _FILE_ENTRY_BYTES
        )

    @property
    def file_bytes(self) -> int:
        """A workspace file's bytes (``GET /v1/session/files/{path}``)."""
        return self.max_body_bytes + _ENVELOPE_BYTES

    @property
    def fs_bytes(self) -> int:
        """A directory listing or a filesystem call's result (a file read inside, base64)."""
        return int(self.max_body_bytes * _BASE64_FACTOR) + self.answer_bytes


DEFAULT_CAPS = AnswerCaps()

CEILING_ENV: dict[str, str] = {
    "max_stdout_bytes": "SANDCELL_ANSWER_MAX_OUTPUT_BYTES",
    "max_stderr_bytes": "SANDCELL_ANSWER_MAX_OUTPUT_BYTES",
    "output_scan_bytes": "SANDCELL_ANSWER_OUTPUT_SCAN_BYTES",
    "max_output_files": "SANDCELL_ANSWER_MAX_OUTPUT_FILES",
    "max_body_bytes": "SANDCELL_ANSWER_MAX_BODY_BYTES",
    "max_timeout_ms": "SANDCELL_ANSWER_MAX_TIMEOUT_MS",
}
"""The ceiling's fields an operator sets (``OrchestratorSettings.answer_caps``), and the
variable each is read from. Not ``SANDCELL_RUNNER_*``: the local provider passes those
on to its runners, and these are this side's, whatever the runners are told."""


def past_ceiling(
    exc: AnswerTooLargeError, caps: AnswerCaps, beyond: tuple[PastCeiling, ...]
) -> AnswerCeilingError | None:
    """``exc`` as the ceiling's doing (``AnswerCeilingError``, naming the variables), when
    the ceiling holds lower (``beyond``) a stated limit that sets this kind of answer's
    cap: a file's, its largest body; a run's, its output, scanned files and file count;
    an error body's or any other answer's, none. None: ``exc`` stands as it is."""
    if (
        isinstance(exc, AnswerCeilingError)
        or exc.cap is None
        or exc.cap in (caps.error_bytes, caps.answer_bytes, caps.event_line_bytes)
    ):
        return None
    file_cap = exc.cap in (caps.file_bytes, caps.fs_bytes)
    past = [
        p
        for p in beyond
        if p.runner_env != _TIMEOUT_ENV and (p.runner_env == _BODY_ENV) == file_cap
    ]
    if not past:
        return None
    raise_these = " and ".join(sorted({p.ceiling_env for p in past}))
    detail = (
        "the sandbox's runner is configured to answer more than this orchestrator reads"
        f" ({'; '.join(map(str, past))}): raise {raise_these}, or lower the runner's limits"
    )
    return AnswerCeilingError(f"{exc}; {detail}", cap=exc.cap, public_detail=detail)


@functools.cache
def warn_past_ceiling(beyond: tuple[PastCeiling, ...]) -> None:
    """One warning per process for each way runners state limits past the ceiling
    (every sandbox of a fleet states the same ones)."""
    if beyond:
        log.warning(
            "runners state limits above this orchestrator's answer ceiling; their answers"
            " are read only up to it: %s",
            "; ".join(map(str, beyond)),
        )


def _too_large(where: str, cap: int) -> AnswerTooLargeError:
    return AnswerTooLargeError(f"{where}: the runner's answer exceeds {cap} bytes", cap=cap)


def _too_slow(where: str, budget_s: float) -> RunnerAnswerError:
    return RunnerAnswerError(f"{where}: the runner's answer took over {budget_s:.1f}s to arrive")


def _decoder(response: httpx.Response, where: str) -> zlib._Decompress | None:
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(zlib.MAX_WBITS | 16)
    if encoding == "deflate":
        return zlib.decompressobj()
    raise RunnerAnswerError(f"{where}: an answer in content encoding {encoding[:32]!r}")


async def _pieces(response: httpx.Response, where: str) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive, decoded, each piece at most one raw chunk
    or ``DECODED_PIECE_BYTES``."""
    if response.is_stream_consumed:
        # Read already, bounded, by an auth flow (lambda_auth's refusal check).
        yield response.content
        return
    decoder = _decoder(response, where)
    async for raw in response.aiter_raw():
        if decoder is None:
            yield raw
            continue
        data = raw
        while data:
            try:
                out = decoder.decompress(data, DECODED_PIECE_BYTES)
            except zlib.error:
                raise RunnerAnswerError(f"{where}: a corrupt compressed answer") from None
            if out:
                yield out
            data = decoder.unconsumed_tail
    # What is left once all input went in is under one window (32 KiB).
    if decoder is not None and (tail := decoder.flush()):
        yield tail


async def read_bounded(
    response: httpx.Response,
    *,
    max_bytes: int,
    budget_s: float | None,
    clock: Callable[[], float],
    where: str,
) -> bytes:
    """The whole (decoded) body of a streamed ``response``, at most ``max_bytes``.

    Refused at once when ``Content-Length`` says more; otherwise the read stops at
    the first chunk past the cap, so at most ``max_bytes`` plus one chunk is held.
    ``budget_s``: the total time the body may take to arrive (each read's own
    timeout bounds a silence; this bounds a drip). The caller closes ``response``.
    """
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(where, max_bytes)
    body = bytearray()
    started = clock()
    async for chunk in _pieces(response, where):
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(where, max_bytes)
        if budget_s is not None and clock() - started > budget_s:
            raise _too_slow(where, budget_s)
    return bytes(body)


async def read_lines(
    response: httpx.Response,
    *,
    max_line_bytes: int,
    budget_s: float | None,
    clock: Callable[[], float],
    where: str,
) -> AsyncIterator[bytes]:
    """The NDJSON lines of a streamed ``response`` (without their ``\\n``), each bounded.

    A line longer than ``max_line_bytes`` (an endless one included) raises once the
    partial line is past it. ``budget_s``: the total time spent waiting for the
    runner's bytes (not the caller's time on each yielded line); None for streams
    that legitimately last (a process's events, kept alive by the runner).
    """
    pending = bytearray()
    chunks = _pieces(response, where)
    waited = 0.0
    while True:
        started = clock()
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        waited += clock() - started
        if budget_s is not None and waited > budget_s:
            raise _too_slow(where, budget_s)
        pending += chunk
        start = 0
        lines: list[bytes] = []
        while (end := pending.find(b"\n", start)) >= 0:
            lines.append(bytes(pending[start:end]))
            start = end + 1
        del pending[:start]
        if len(pending) > max_line_bytes or any(len(line) > max_line_bytes for line in lines):
            raise _too_large(where, max_line_bytes)
        for line in lines:
            yield line
    if pending:
        yield bytes(pending)
