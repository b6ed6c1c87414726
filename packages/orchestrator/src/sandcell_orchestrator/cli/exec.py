"""``sandcell exec``: run code in a sandbox, print what it printed, exit with its code."""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from sandcell_protocol import (
    EgressOmittedEvent,
    EgressPolicy,
    EgressRefusedEvent,
    ExecuteRequest,
    ExecuteResult,
    FileRef,
    RunStatus,
    StdoutEvent,
    TurnEvent,
    encode,
    runtime_session_id,
    scoped_storage_session,
)

from ..bootstrap import Services, open_services
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
from .summary import print_summary

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
    run.add_argument(
        "--env",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        type=_env_pair,
        help="an environment variable for the job (repeatable)",
    )
    run.add_argument(
        "--out", metavar="DIR", type=Path, help="write the files the job made or changed into DIR"
    )
    run.add_argument(
        "--wait-s",
        type=positive_float,
        metavar="N",
        help="wait up to N s for a session another call is using [0: exit 75 at once]",
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
            env=dict(args.env),
            **({"timeout_ms": max(1, round(args.timeout_s * 1000))} if args.timeout_s else {}),
        )
        session_id = None
        if hint is not None:
            session_id = runtime_session_id(identity.namespace, identity.user_id, hint)
            # Recorded before the turn: a turn that dies after its checkpoint still
            # leaves a session the user can list and destroy.
            await asyncio.to_thread(CliSessions(settings.home).touch, session_id, hint=hint)
        # Human output streams: each chunk is printed as the job produces it, the
        # summary comes last. --json prints one ExecuteResult at the end.
        on_output = None if args.json else _Echo(out, err)
        if args.wait_s:
            services.execution.session_wait_ms = round(args.wait_s * 1000)
        before = None
        if session_id is not None:
            before = await services.manager.current_checkpoint(session_id)
        try:
            result = await services.execution.execute(
                request, identity, hint=hint, on_output=on_output, egress=egress
            )
        except asyncio.CancelledError:
            await _say_interrupted(services, err, hint=hint, session_id=session_id, before=before)
            raise
        except SessionBusyError:
            raise SessionBusyExit(
                f"session {hint!r} is busy: another call is running a turn in it;"
                " this turn did not run (retry when that one has finished, or wait with --wait-s N)"
            ) from None
    if args.out is not None:
        await asyncio.to_thread(_write_out, result, args.out, err)
    if args.json:
        out.write(encode(result).decode() + "\n")
    else:
        print_summary(result, request, err, hint=hint)
    return job_exit_code(result)


def _egress_policy(rules: Sequence[str]) -> EgressPolicy | None:
    """``--allow-host`` rules as a policy (None without any: the sandbox's default)."""
    if not rules:
        return None
    try:
        return EgressPolicy(mode="allow", allow=tuple(rules))
    except ValueError as exc:
        raise UsageError(f"--allow-host: {exc}") from None


async def _say_interrupted(
    services: Services, err: TextIO, *, hint: str | None, session_id: str | None, before: str | None
) -> None:
    """Ctrl-C or SIGTERM mid-turn: the output so far is printed; say what became of the
    session (the turn has finished its cleanup by the time this runs)."""
    err.write("sandcell: interrupted: the job was stopped\n")
    if session_id is not None:
        after = await services.manager.current_checkpoint(session_id)
        if after != before:
            err.write(f"sandcell: session {hint!r} keeps what the job wrote before it stopped\n")
        else:
            err.write(
                f"sandcell: session {hint!r} is as its last completed turn left it"
                " (this turn's changes could not be saved)\n"
            )
    err.flush()


def _env_pair(raw: str) -> tuple[str, str]:
    key, sep, value = raw.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--env wants KEY=VALUE, got {raw[:40]!r}")
    return key, value


def _write_out(result: ExecuteResult, out_dir: Path, err: TextIO) -> None:
    """The turn's output files into ``out_dir``, under their workspace paths.

    Small files travel inline in the result; a larger one is named with the
    command that fetches it from the session.
    """
    root = out_dir.resolve()
    for file in result.files:
        target = (root / file.name).resolve()
        if not target.is_relative_to(root) or file.symlink_target is not None:
            err.write(f"sandcell: --out: skipped {file.name!r} (a link or outside {out_dir})\n")
            continue
        if file.content_b64 is None:
            err.write(
                f"sandcell: --out: {file.name} ({file.size} bytes) is too large to travel inline;"
                f" fetch it with: sandcell files get --session HINT {file.name}\n"
            )
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(file.content_b64))


class _Echo:
    """Prints output chunks as they arrive (a terminal or pipe write: small, then flushed),
    and each egress refusal as a ``sandcell:`` line on stderr (the job's own stdout stays
    the job's)."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self._out = out
        self._err = err

    def __call__(self, event: TurnEvent) -> None:
        if isinstance(event, EgressRefusedEvent):
            text = f"sandcell: egress refused ({event.reason}): {_destination(event)}\n"
            stream = self._err
        elif isinstance(event, EgressOmittedEvent):
            text = f"sandcell: egress refused {event.count} more (not shown)\n"
            stream = self._err
        else:
            text = event.data
            stream = self._out if isinstance(event, StdoutEvent) else self._err
        stream.write(text)
        stream.flush()


def _destination(event: EgressRefusedEvent) -> str:
    where = " ".join(part for part in (event.name, event.address) if part) or "?"
    return f"{where} port {event.port} ({event.transport})"


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
