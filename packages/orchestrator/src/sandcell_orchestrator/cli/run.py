"""``sandcell run``: a cell in a code context of a session; variables persist between calls.

    sandcell run --session demo "x = 41"
    sandcell run --session demo "x + 1"          # prints 42

Output is printed as it comes; the value of the last expression (and anything
``display()``ed) is printed as text; images are written to files under
``--out`` (default ``$SANDCELL_HOME/outputs/<session>``) and their paths printed.
``--json`` prints the whole ``ContextRunResult`` instead.

Keeping variables between two processes needs the sandbox to outlive the first:
on the local provider its runner is started detached and exits by itself after
``SANDCELL_IDLE_TIMEOUT_S`` without a request (the next call then restores the
files, and the context answers ``context_lost``: ``--restart`` starts it fresh).
With an embedded registry and another provider the sandbox is parked after
each call as ``sandcell exec`` does, so only files persist.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from sandcell_protocol import ExecuteRequest, encode, runtime_session_id
from sandcell_protocol import contexts as cx

from ..bootstrap import open_services
from ..config import OrchestratorSettings
from ..contexts import default_context_id
from ..errors import SessionBusyError
from ..providers.local_settings import LocalSettings
from ..sessions.execution import Identity
from .common import CLI_NAMESPACE, SessionBusyExit, UsageError, hint_argument, os_user
from .exec import read_files, store_files
from .session_index import CliSessions

__all__ = ["add_parser", "context_exit_code", "run_cell"]

_EXTENSIONS = {"image/png": "png", "image/jpeg": "jpg", "image/svg+xml": "svg"}
_TEXT_ORDER = ("text/plain", "text/markdown")


def add_parser(commands: Any) -> None:
    """Add ``run`` to the ``sandcell`` sub-command parsers."""
    run = commands.add_parser("run", help="run a cell in a session's code context")
    run.add_argument("code", metavar="CODE", help="the code to run, or - to read it from stdin")
    run.add_argument(
        "--session", metavar="HINT", required=True, help="runtime session (variables persist)"
    )
    run.add_argument(
        "--context", metavar="ID", help="code context [the language's default context]"
    )
    run.add_argument("--language", default="python", help="the code's language [python]")
    run.add_argument(
        "--file", metavar="PATH", action="append", default=[], help="deliver a file (repeatable)"
    )
    run.add_argument("--out", metavar="DIR", help="where images are written")
    run.add_argument("--restart", action="store_true", help="restart the context first")
    run.add_argument("--json", action="store_true", help="print the ContextRunResult as JSON")
    run.add_argument("--timeout-s", type=float, metavar="N", help="cell timeout [30]")


def _warm_settings(settings: OrchestratorSettings) -> tuple[OrchestratorSettings, bool]:
    """Settings under which this call's sandbox outlives it, and whether it does."""
    provider = settings.provider
    if isinstance(provider, LocalSettings):
        detached = dataclasses.replace(provider, detached_idle_s=int(settings.idle_timeout_s))
        return dataclasses.replace(settings, provider=detached), True
    return settings, settings.distributed_registry


async def run_cell(
    args: argparse.Namespace, settings: OrchestratorSettings, out: TextIO, err: TextIO
) -> int:
    hint = hint_argument(args.session)
    if args.context is not None and not cx.is_context_id(args.context):
        raise UsageError("--context: must be 1-64 of A-Z a-z 0-9 . _ -")
    if args.timeout_s is not None and not args.timeout_s > 0:
        raise UsageError("--timeout-s: must be > 0")
    code = await asyncio.to_thread(sys.stdin.read) if args.code == "-" else args.code
    contents = await asyncio.to_thread(read_files, args.file)
    identity = Identity(namespace=CLI_NAMESPACE, user_id=os_user())
    session_id = runtime_session_id(identity.namespace, identity.user_id, hint)
    await asyncio.to_thread(CliSessions(settings.home).touch, session_id, hint=hint)
    settings, warm = _warm_settings(settings)

    def show(event: cx.ContextEvent) -> None:
        if args.json:
            return
        if isinstance(event, cx.ContextStdoutEvent):
            out.write(event.data)
            out.flush()
        elif isinstance(event, cx.ContextStderrEvent):
            err.write(event.data)
            err.flush()

    async with open_services(settings, keep_warm=warm, keep_sandboxes=warm) as services:
        request = ExecuteRequest(
            language=args.language,
            code=code,
            files=await store_files(services.inputs, contents),
            **({"timeout_ms": max(1, round(args.timeout_s * 1000))} if args.timeout_s else {}),
        )
        execution = services.execution
        try:
            if args.restart:
                context_id = args.context or default_context_id(args.language)
                await execution.contexts.restart_or_create(session_id, context_id, args.language)
            result = await execution.run_code(
                request, identity, hint=hint, context_id=args.context, on_event=show
            )
        except SessionBusyError:
            raise SessionBusyExit(
                f"session {hint!r} is busy: another call is running in it;"
                " this cell did not run (retry when that one has finished)"
            ) from None
    if args.json:
        out.write(encode(result).decode() + "\n")
    else:
        directory = Path(args.out) if args.out else settings.home / "outputs" / hint
        await asyncio.to_thread(_print_results, result, directory, out, err)
    return context_exit_code(result)


def _print_results(result: cx.ContextRunResult, directory: Path, out: TextIO, err: TextIO) -> None:
    for index, item in enumerate(result.results):
        images = [(mime, item.data[mime]) for mime in _EXTENSIONS if mime in item.data]
        for mime, data in images:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"cell{result.execution_count}-{index}.{_EXTENSIONS[mime]}"
            raw = data.encode() if mime == "image/svg+xml" else base64.b64decode(data)
            path.write_bytes(raw)
            out.write(f"{path.resolve()}\n")
        if images:
            continue
        text = next((item.data[m] for m in _TEXT_ORDER if m in item.data), None)
        if isinstance(text, str):
            out.write(text + ("" if text.endswith("\n") else "\n"))
    out.flush()
    if result.error is not None:
        err.write(_plain(result.error.traceback))
    notes = []
    if result.status is not cx.ContextStatus.OK:
        why = f": {result.message}" if result.message else ""
        notes.append(f"status {result.status.value}{why}")
    if result.context_lost:
        notes.append("the context's variables are gone (--restart starts it fresh)")
    if result.files:
        notes.append("files: " + ", ".join(f.name for f in result.files))
    for note in notes:
        err.write(f"sandcell: {note}\n")
    err.flush()


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def _plain(text: str) -> str:
    return _ANSI_RE.sub("", text)


def context_exit_code(result: cx.ContextRunResult) -> int:
    """0 for a cell that ran, 1 when it raised; 124 timeout, 137 memory kill."""
    if result.status is cx.ContextStatus.TIMEOUT:
        return 124
    if result.status is cx.ContextStatus.MEMORY_LIMIT:
        return 137
    return 0 if result.status is cx.ContextStatus.OK else 1
