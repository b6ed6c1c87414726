"""``sandcell``: run code in a sandbox from a shell, serve the HTTP API, manage sessions.

    sandcell exec [--session HINT] [--language python] [--file PATH]... [--json]
                  [--timeout-s N] (CODE | -)
    sandcell serve [--host H] [--port P]
    sandcell sessions list [--json]
    sandcell sessions destroy (ID | HINT)

Every ``sandcell exec`` is its own process. With the embedded defaults its
registry dies with it and its sandbox is destroyed on exit, so a session's files
reach the next call through the snapshot store: the turn checkpoints at its end
and the next call restores before it runs. Which sessions the CLI made is kept
in ``$SANDCELL_HOME/cli-sessions.json``, since no registry outlives the process.

Exit codes: the job's own (124 for a timeout, 137 when killed for memory or by a
signal, 1 for another failure without one); 2 when sandcell itself failed (one
line on stderr, never a traceback); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import logging
import os
import pwd
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

from sandcell_protocol import (
    ExecuteRequest,
    ExecuteResult,
    FileRef,
    ProtocolError,
    RunStatus,
    encode,
    is_runtime_session_id,
    runtime_session_id,
    validate_hint,
)

from .bootstrap import open_services
from .config import OrchestratorSettings
from .errors import SandcellError
from .sessions.execution import Identity
from .sessions.inputs import DirectoryInputSource

__all__ = ["CLI_NAMESPACE", "build_parser", "job_exit_code", "main"]

T = TypeVar("T")
log = logging.getLogger(__name__)

CLI_NAMESPACE = "cli"
"""The tenant namespace of every CLI session; the user id is the OS user name."""
CLI_STORAGE_SESSION = "cli"
"""Where ``--file`` inputs are kept in the input source (content-addressed)."""
EXIT_SANDCELL_ERROR = 2
EXIT_INTERRUPTED = 130


class _UsageError(Exception):
    """A bad argument found after parsing (an unreadable file, an invalid hint)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``sandcell`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="sandcell", description="Run untrusted code in sandboxes."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    run.add_argument("--timeout-s", type=_positive_float, metavar="N", help="job timeout [30]")

    serve = commands.add_parser("serve", help="run the HTTP API for control planes")
    serve.add_argument("--host", help="listen address [SANDCELL_SERVE_HOST or 127.0.0.1]")
    serve.add_argument("--port", type=int, help="listen port [SANDCELL_SERVE_PORT or 8000]")

    sessions = commands.add_parser("sessions", help="list or destroy runtime sessions")
    actions = sessions.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="list sessions")
    listing.add_argument("--json", action="store_true", help="print JSON")
    destroy = actions.add_parser("destroy", help="destroy a session, its sandbox and checkpoint")
    destroy.add_argument("session", metavar="ID", help="an rt_… id, or a hint given to exec")
    return parser


def _positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def main(argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    environ = os.environ if env is None else env
    logging.basicConfig(
        level=logging.INFO if args.command == "serve" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        if args.command == "serve"
        else "sandcell: %(message)s",
    )
    # httpx logs every runner request at INFO: noise to an operator.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        settings = OrchestratorSettings.from_env(environ)
        if args.command == "serve":
            from .serve.app import serve

            return serve(settings, host=args.host, port=args.port)
        if args.command == "exec":
            return _run(lambda: _exec(args, settings, sys.stdout, sys.stderr))
        if args.action == "list":
            return _run(lambda: _sessions_list(args, settings, sys.stdout))
        return _run(lambda: _sessions_destroy(args, settings, sys.stdout))
    except (SandcellError, ProtocolError, _UsageError) as exc:
        return _fail(str(exc))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return EXIT_INTERRUPTED
    except Exception as exc:
        # Unknown errors may carry anything in their text; name the type only.
        if environ.get("SANDCELL_DEBUG") == "1":
            raise
        return _fail(f"internal error ({type(exc).__name__}); SANDCELL_DEBUG=1 shows a traceback")


def _fail(message: str) -> int:
    sys.stderr.write(f"sandcell: {message}\n")
    return EXIT_SANDCELL_ERROR


def _run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine; SIGTERM cancels it like Ctrl-C does, so sandboxes are cleaned up.

    The default SIGTERM action would kill this process before ``open_services``
    could destroy its sandboxes (they would die too, by their parent-death
    signal, but without unmounting their workspaces).
    """

    async def guarded() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is not None:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await make()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    return asyncio.run(guarded())


# -- exec ----------------------------------------------------------------------------


def os_user() -> str:
    """The OS user name (the CLI's ``user_id``); the numeric uid if it has none."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


async def _exec(
    args: argparse.Namespace, settings: OrchestratorSettings, out: TextIO, err: TextIO
) -> int:
    hint = _hint(args.session) if args.session is not None else None
    code = await asyncio.to_thread(sys.stdin.read) if args.code == "-" else args.code
    files = await asyncio.to_thread(_store_files, settings.inputs_dir, args.file)
    request = ExecuteRequest(
        language=args.language,
        code=code,
        files=files,
        **({"timeout_ms": max(1, round(args.timeout_s * 1000))} if args.timeout_s else {}),
    )
    identity = Identity(namespace=CLI_NAMESPACE, user_id=os_user())
    async with open_services(settings) as services:
        if hint is not None:
            session_id = runtime_session_id(identity.namespace, identity.user_id, hint)
            # Recorded before the turn: a turn that dies after its checkpoint still
            # leaves a session the user can list and destroy.
            await asyncio.to_thread(_CliSessions(settings.home).touch, session_id, hint=hint)
        result = await services.execution.execute(request, identity, hint=hint)
    if args.json:
        out.write(encode(result).decode() + "\n")
    else:
        _print_human(result, out, err)
    return job_exit_code(result)


def _hint(raw: str) -> str:
    try:
        return validate_hint(raw)
    except ProtocolError:
        raise _UsageError("--session: must be 1-128 of A-Z a-z 0-9 . _ : -") from None


def _store_files(inputs_dir: Path, paths: Sequence[str]) -> list[FileRef]:
    """Keep each file in the input source and refer to it by its content id."""
    source = DirectoryInputSource(inputs_dir)
    refs: list[FileRef] = []
    for raw in paths:
        path = Path(raw)
        name = path.name
        if any(ref.name == name for ref in refs):
            raise _UsageError(f"--file: two files are named {name!r}")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise _UsageError(f"--file {raw}: {exc.strerror or exc}") from None
        object_id = source.store(CLI_STORAGE_SESSION, data)
        refs.append(FileRef(storage_session=CLI_STORAGE_SESSION, object_id=object_id, name=name))
    return refs


def _print_human(result: ExecuteResult, out: TextIO, err: TextIO) -> None:
    out.write(result.stdout)
    out.flush()
    err.write(result.stderr)
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


# -- sessions ------------------------------------------------------------------------


class _CliSessions:
    """The sessions this CLI made: ``$SANDCELL_HOME/cli-sessions.json`` (hint, last use).

    Read-modify-write under an ``flock``, replaced atomically, so concurrent CLI
    calls neither lose entries nor read a torn file.
    """

    def __init__(self, home: Path, *, clock: Callable[[], float] = time.time) -> None:
        self._path = home / "cli-sessions.json"
        self._clock = clock

    def entries(self) -> dict[str, dict[str, Any]]:
        with self._locked():
            return self._read()

    def touch(self, session_id: str, *, hint: str) -> None:
        with self._locked():
            entries = self._read()
            entries[session_id] = {"hint": hint, "last_used_s": self._clock()}
            self._write(entries)

    def remove(self, session_id: str) -> bool:
        with self._locked():
            entries = self._read()
            if entries.pop(session_id, None) is None:
                return False
            self._write(entries)
            return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self._path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self._path.read_text())
            sessions = data["sessions"]
            return {
                k: v
                for k, v in sessions.items()
                if is_runtime_session_id(k) and isinstance(v, dict)
            }
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            log.warning("%s is unreadable; starting a new session list", self._path)
            return {}

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        temp = self._path.with_name(f".{self._path.name}.{os.getpid()}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"sessions": entries}, handle, indent=1, sort_keys=True)
        temp.replace(self._path)


async def _sessions_list(
    args: argparse.Namespace, settings: OrchestratorSettings, out: TextIO
) -> int:
    entries = await asyncio.to_thread(_CliSessions(settings.home).entries)
    rows: list[dict[str, Any]] = []
    async with open_services(settings) as services:
        records = {r.session_id: r for r in await services.execution.list_sessions()}
        for session_id in sorted(set(records) | set(entries)):
            record = records.get(session_id)
            entry = entries.get(session_id, {})
            saved = await services.manager.current_checkpoint(session_id) is not None
            # Without a registry record (the embedded default between calls) a
            # session lives on as its checkpoint only.
            state = record.state if record else ("saved" if saved else "empty")
            used = record.updated_at_s if record else entry.get("last_used_s")
            rows.append(
                {
                    "session_id": session_id,
                    "hint": entry.get("hint"),
                    "state": state,
                    "checkpoint": saved,
                    "last_used_s": used,
                }
            )
    if args.json:
        out.write(json.dumps(rows, indent=1) + "\n")
        return 0
    for row in rows:
        used = row["last_used_s"]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(used)) if used else "-"
        out.write(f"{row['session_id']}  {row['state']:<9}  {when}  {row['hint'] or '-'}\n")
    return 0


async def _sessions_destroy(
    args: argparse.Namespace, settings: OrchestratorSettings, out: TextIO
) -> int:
    raw: str = args.session
    session_id = (
        raw
        if is_runtime_session_id(raw)
        else runtime_session_id(CLI_NAMESPACE, os_user(), _hint(raw))
    )
    async with open_services(settings) as services:
        had_checkpoint = await services.manager.current_checkpoint(session_id) is not None
        had_record = await services.execution.destroy_session(session_id)
    listed = await asyncio.to_thread(_CliSessions(settings.home).remove, session_id)
    if not (had_checkpoint or had_record or listed):
        sys.stderr.write(f"sandcell: no session {raw}\n")
        return 1
    out.write(f"destroyed {session_id}\n")
    return 0
