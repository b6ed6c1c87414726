"""``sandcell``: run code in a sandbox from a shell, serve the HTTP API, manage sessions.

    sandcell exec [--session HINT] [--language python] [--file PATH]... [--json]
                  [--timeout-s N] (CODE | -)
    sandcell run --session HINT [--context ID] [--language python] [--file PATH]...
                 [--out DIR] [--restart] [--json] [--timeout-s N] (CODE | -)
    sandcell serve [--host H] [--port P]
    sandcell sessions list [--json]
    sandcell sessions destroy (ID | HINT)
    sandcell files (ls [DIR] | get PATH [DEST|-] | put SRC [PATH]) --session HINT
    sandcell instances (create|ls|get|write|run|logs|errors|analysis|rm) ...  (docs/apps.md)

One module per command (``exec.py``, ``sessions.py``, ``serve.py``), each adding
its parser and running it; ``common.py`` holds what they share.

Every ``sandcell exec`` is its own process. With the embedded defaults they
share one registry file (``$SANDCELL_HOME/registry.sqlite3``), so a session has
one holder at a time across processes: a second call on a busy session does not
run its turn and exits 75 saying so. A call's sandbox dies with it, so at the end
of its turn it checkpoints and parks (destroys) the sandbox while it still holds
the session; the next call restores before it runs. Which hints the CLI was
given is kept in ``$SANDCELL_HOME/cli-sessions.json``.

Exit codes: the job's own (124 for a timeout, 137 when killed for memory or by a
signal, 1 for another failure without one); 2 when sandcell itself failed (one
line on stderr, never a traceback); 75 when the session was busy (the turn did
not run); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from sandcell_protocol import PROTOCOL_VERSION, ProtocolError

from ..config import LogLevel, OrchestratorSettings
from ..errors import SandcellError
from ..providers.local_settings import LocalSettings
from . import exec as exec_command
from . import files as files_command
from . import instances as instances_command
from . import run as run_command
from . import serve as serve_command
from . import sessions as sessions_command
from .common import (
    CLI_NAMESPACE,
    EXIT_INTERRUPTED,
    EXIT_SANDCELL_ERROR,
    EXIT_SESSION_BUSY,
    SessionBusyExit,
    UsageError,
    run_async,
)
from .exec import job_exit_code

__all__ = ["CLI_NAMESPACE", "build_parser", "job_exit_code", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``sandcell`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="sandcell",
        description="Run untrusted code in sandboxes.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    exec_command.add_parser(commands)
    run_command.add_parser(commands)
    serve_command.add_parser(commands)
    sessions_command.add_parser(commands)
    files_command.add_parser(commands)
    instances_command.add_parser(commands)
    return parser


_EPILOG = """\
examples:
  sandcell exec --session demo "print(6*7)"   files persist across calls of a session
  sandcell run --session nb "x = 1"           variables persist in a code context
  sandcell serve                              the HTTP API (SANDCELL_API_KEYS=key=tenant)

'sandcell COMMAND --help' describes a command. Settings are SANDCELL_* environment
variables, read and checked at start-up (README.md, "Configuration").
exit codes: the job's own (124 timeout, 137 killed); 2 sandcell failed; 75 session
busy; 130 interrupted"""


def _version() -> str:
    """``sandcell X (protocol Y)``: what an operator quotes in a bug report."""
    try:
        installed = importlib.metadata.version("sandcell-orchestrator")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        installed = "unknown"
    return f"sandcell {installed} (protocol {PROTOCOL_VERSION})"


def main(argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    environ = os.environ if env is None else env
    try:
        if args.command == "instances":
            # A client of a running serve: no local services, no settings needed.
            _configure_logging(args.command, None)
            return instances_command.run_instances(args, environ, sys.stdout, sys.stderr)
        # Before logging is set up: a bad setting is one line on stderr (``_fail``).
        settings = OrchestratorSettings.from_env(environ)
        _configure_logging(args.command, settings.log_level)
        if args.command != "serve":
            settings = _one_shot(settings)
        if args.command == "serve":
            return serve_command.run_serve(args, settings)
        if args.command == "files":
            return run_async(lambda: files_command.run_files(args, settings, sys.stdout))
        if args.command == "exec":
            return run_async(lambda: exec_command.run_exec(args, settings, sys.stdout, sys.stderr))
        if args.command == "run":
            return run_async(lambda: run_command.run_cell(args, settings, sys.stdout, sys.stderr))
        if args.action == "list":
            return run_async(lambda: sessions_command.run_list(args, settings, sys.stdout))
        return run_async(lambda: sessions_command.run_destroy(args, settings, sys.stdout))
    except SessionBusyExit as exc:
        sys.stderr.write(f"sandcell: {exc}\n")
        return EXIT_SESSION_BUSY
    except (SandcellError, ProtocolError, UsageError) as exc:
        return _fail(str(exc))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return EXIT_INTERRUPTED
    except Exception as exc:
        # Unknown errors may carry anything in their text; name the type only.
        if environ.get("SANDCELL_DEBUG") == "1":
            raise
        return _fail(f"internal error ({type(exc).__name__}); SANDCELL_DEBUG=1 shows a traceback")


def _configure_logging(command: str, level: LogLevel | None) -> None:
    """``SANDCELL_LOG_LEVEL``, else ``info`` for ``serve`` and ``warning`` for the rest."""
    serving = command == "serve"
    logging.basicConfig(
        level=(level or ("info" if serving else "warning")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        if serving
        else "sandcell: %(message)s",
    )
    # httpx logs every runner request at INFO: noise to an operator.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _one_shot(settings: OrchestratorSettings) -> OrchestratorSettings:
    """Settings for a command that launches a runner or two and exits: no runner zygote
    (its imports would cost as much as the plain launches it could replace)."""
    if isinstance(settings.provider, LocalSettings):
        return dataclasses.replace(
            settings, provider=dataclasses.replace(settings.provider, zygote=False)
        )
    return settings


def _fail(message: str) -> int:
    sys.stderr.write(f"sandcell: {message}\n")
    return EXIT_SANDCELL_ERROR
