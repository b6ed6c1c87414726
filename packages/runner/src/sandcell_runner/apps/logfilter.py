"""Regex filters over log lines, matched in a killable child so a bad pattern cannot hang us.

Python's ``re`` backtracks: ``(a+)+$`` over a long line runs for ever, and a thread
cannot be stopped. The pattern is validated here (length, syntax), then matched by
a short-lived interpreter (``-I -S``: no site, ~15 ms to start) under a time budget;
past it the child is killed and the caller gets a 400 naming the budget. Lines are
already capped in length by the log buffer, which bounds the work per line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator

from ..errors import BadRequestError

MAX_PATTERN_CHARS = 200

# Reads the pattern from argv and one JSON-encoded line per input line; answers
# "1" or "0" per line, flushed, so a follower can ask line by line.
_WORKER = """\
import json, re, sys
pattern = re.compile(sys.argv[1])
out = sys.stdout
for raw in sys.stdin:
    out.write("1\\n" if pattern.search(json.loads(raw)) else "0\\n")
    out.flush()
"""


class FilterTooSlowError(BadRequestError):
    """The filter did not finish within its time budget (likely catastrophic backtracking)."""


def validate_pattern(pattern: str) -> str:
    """The pattern if it is short enough and compiles; else ``BadRequestError`` (400)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise BadRequestError(f"filter longer than {MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise BadRequestError(f"filter is not a valid regular expression: {exc}") from None
    return pattern


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, pattern: str) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            "-c",
            _WORKER,
            pattern,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env={},
        )
        return cls(process)

    async def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await self.process.wait()


def _encode(lines: list[str]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def match_lines(pattern: str, lines: list[str], *, budget_s: float = 2.0) -> list[bool]:
    """Which lines ``pattern`` finds a match in (``re.search``), within ``budget_s``."""
    if not lines:
        return []
    worker = await _Worker.start(pattern)
    try:
        async with asyncio.timeout(budget_s):
            out, _ = await worker.process.communicate(_encode(lines))
    except TimeoutError:
        raise FilterTooSlowError(
            f"filter did not finish within {budget_s:g}s; simplify the regular expression"
        ) from None
    finally:
        await worker.stop()
    answers = out.split()
    if len(answers) != len(lines):
        raise BadRequestError("filter could not be applied")
    return [answer == b"1" for answer in answers]


async def filter_stream(
    pattern: str, lines: AsyncIterator[str], *, budget_s: float = 0.5
) -> AsyncIterator[str]:
    """The lines ``pattern`` matches, one worker for the whole stream; a line that takes
    longer than ``budget_s`` ends the stream with a note saying so."""
    worker = await _Worker.start(pattern)
    stdin, stdout = worker.process.stdin, worker.process.stdout
    if stdin is None or stdout is None:  # pragma: no cover - both are PIPE above
        raise RuntimeError("filter worker without pipes")
    try:
        async for line in lines:
            stdin.write(_encode([line]))
            try:
                async with asyncio.timeout(budget_s):
                    await stdin.drain()
                    answer = await stdout.readline()
            except TimeoutError:
                yield f"[sandcell] filter took longer than {budget_s:g}s on a line; stream ended"
                return
            except (BrokenPipeError, ConnectionResetError):
                return
            if answer.strip() == b"1":
                yield line
            elif not answer:
                return
    finally:
        await worker.stop()


__all__ = [
    "MAX_PATTERN_CHARS",
    "FilterTooSlowError",
    "filter_stream",
    "match_lines",
    "validate_pattern",
]
