"""``sandcell exec``: run code in a sandbox, print what it printed, exit with its code."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from sandcell_protocol import (
    EgressPolicy,
    ExecuteRequest,
    ExecuteResult,
    FileRef,
    RunStatus,
    StderrEvent,
    StdoutEvent,
    encode,
    runtime_session_id,
    scoped_storage_session,
)

from ..bootstrap import open_services
from ..config import OrchestratorSettings
from ..errors import SessionBusyError
from ..sessions.execution import Identity
from ..sessions.inputs import InputStore
from .common import (
    CLI_NAMESPACE,
    CLI_STORAGE_SESSION,
    SessionBusyExit,
    UsageError,
    hint_argument,
    os_user,
    positive_float,
)
from .session_index import CliSessions

__all__ = ["add_parser", "job_exit_code", "read_files", "run_exec", "store_files"]


def add_parser(commands: Any) -> None:
    """Add ``exec`` to the ``sandcell`` sub-command parsers."""
    run = commands.add_parser("exec", help="run code in a sandbox")
    run.add_argument("code", metavar="CODE", help="the code to run, or - to read it from stdin")
    run.add_argument(
        "--session", metavar="HINT", help="runtime session: files persist across calls"
    )
    run.add_argument("--language", default="python", help="the code's language [python]")
    run.add_argument(
        "--file", metavar="PATH", action="append", default=[], help="deliver a file (repeatable)"
    )
    run.add_argument("--json", action="store_true", help="print the ExecuteResult as JSON")
    run.add_argument("--timeout-s", type=positive_float, metavar="N", help="job timeout [30]")
    run.add_argument(
        "--allow-host",
        metavar="RULE",
        action="append",
        default=[],
        help="let the job reach RULE: a name, *.domain, CIDR, optionally :port (repeatable;"
        " otherwise it has no network)",
    )


async def run_exec(
    args: argparse.Namespace, settings: OrchestratorSettings, out: TextIO, err: TextIO
) -> int:
    hint = hint_argument(args.session) if args.session is not None else None
    code = await asyncio.to_thread(sys.stdin.read) if args.code == "-" else args.code
    contents = await asyncio.to_thread(read_files, args.file)
    egress = _egress_policy(args.allow_host)
    identity = Identity(namespace=CLI_NAMESPACE, user_id=os_user())
    # With an embedded registry this process's sandboxes die with it: each turn
    # parks its sandbox before it lets go of the session, so no other call reuses
    # one about to vanish. With Redis they stay for the next call, as a service's do.
    async with open_services(settings, keep_warm=settings.distributed_registry) as services:
        request = ExecuteRequest(
            language=args.language,
            code=code,
            files=await store_files(services.inputs, contents),
            **({"timeout_ms": max(1, round(args.timeout_s * 1000))} if args.timeout_s else {}),
        )
        if hint is not None:
            session_id = runtime_session_id(identity.namespace, identity.user_id, hint)
            # Recorded before the turn: a turn that dies after its checkpoint still
            # leaves a session the user can list and destroy.
            await asyncio.to_thread(CliSessions(settings.home).touch, session_id, hint=hint)
        # Human output streams: each chunk is printed as the job produces it, the
        # summary comes last. --json prints one ExecuteResult at the end.
        on_output = None if args.json else _Echo(out, err)
        try:
            result = await services.execution.execute(
                request, identity, hint=hint, on_output=on_output, egress=egress
            )
        except SessionBusyError:
            raise SessionBusyExit(
                f"session {hint!r} is busy: another call is running a turn in it;"
                " this turn did not run (retry when that one has finished)"
            ) from None
    if args.json:
        out.write(encode(result).decode() + "\n")
    else:
        _print_summary(result, err)
    return job_exit_code(result)


def _egress_policy(rules: Sequence[str]) -> EgressPolicy | None:
    """``--allow-host`` rules as a policy (None without any: the sandbox's default)."""
    if not rules:
        return None
    try:
        return EgressPolicy(mode="allow", allow=tuple(rules))
    except ValueError as exc:
        raise UsageError(f"--allow-host: {exc}") from None


class _Echo:
    """Prints output chunks as they arrive (a terminal or pipe write: small, then flushed)."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self._out = out
        self._err = err

    def __call__(self, event: StdoutEvent | StderrEvent) -> None:
        stream = self._out if isinstance(event, StdoutEvent) else self._err
        stream.write(event.data)
        stream.flush()


def read_files(paths: Sequence[str]) -> list[tuple[str, bytes]]:
    """``(base name, bytes)`` of each ``--file`` (blocking)."""
    contents: list[tuple[str, bytes]] = []
    for raw in paths:
        path = Path(raw)
        name = path.name
        if any(seen == name for seen, _ in contents):
            raise UsageError(f"--file: two files are named {name!r}")
        try:
            contents.append((name, path.read_bytes()))
        except OSError as exc:
            raise UsageError(f"--file {raw}: {exc.strerror or exc}") from None
    return contents


async def store_files(inputs: InputStore, contents: list[tuple[str, bytes]]) -> list[FileRef]:
    """Keep each file in the input store under its content id and refer to it."""
    scoped = scoped_storage_session(CLI_NAMESPACE, CLI_STORAGE_SESSION)
    refs: list[FileRef] = []
    for name, data in contents:
        object_id = hashlib.sha256(data).hexdigest()
        await inputs.write(scoped, object_id, data)
        refs.append(FileRef(storage_session=CLI_STORAGE_SESSION, object_id=object_id, name=name))
    return refs


def _print_summary(result: ExecuteResult, err: TextIO) -> None:
    """The lines after the job's own output: status, truncation, files."""
    notes = []
    if result.status != RunStatus.OK:
        exit_text = "" if result.exit_code is None else f", exit code {result.exit_code}"
        signal_text = "" if result.signal is None else f", signal {result.signal}"
        notes.append(f"status {result.status}{exit_text}{signal_text}")
    for stream, truncated in (
        ("stdout", result.stdout_truncated),
        ("stderr", result.stderr_truncated),
    ):
        if truncated:
            notes.append(f"{stream} truncated")
    if result.files:
        notes.append("files: " + ", ".join(f.name for f in result.files))
    for note in notes:
        err.write(f"sandcell: {note}\n")
    err.flush()


def job_exit_code(result: ExecuteResult) -> int:
    """The exit code a shell would have seen had the job run there."""
    if result.status == RunStatus.TIMEOUT:
        return 124
    if result.status in (RunStatus.MEMORY_LIMIT, RunStatus.SIGNALED):
        return 137
    ok = result.status == RunStatus.OK
    code = (result.exit_code or 0) & 0xFF
    # A failure must never read as success, even when its code wraps to 0.
    return code if ok or code else 1
