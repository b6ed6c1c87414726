"""``sandcell files ls|get|put --session HINT``: a session's workspace files from a shell.

Each call holds the session like a turn does (a busy session exits 75), attaches
its sandbox (restoring the current checkpoint into a new one), does the one file
operation, checkpoints after a ``put``, and parks the sandbox before it lets go,
as ``sandcell exec`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, TextIO

from sandcell_protocol import runtime_session_id

from ..bootstrap import Services, open_services
from ..config import OrchestratorSettings
from ..errors import SessionBusyError
from .common import CLI_NAMESPACE, SessionBusyExit, UsageError, hint_argument, os_user

__all__ = ["add_parser", "run_files"]


def add_parser(commands: Any) -> None:
    """Add ``files ls|get|put`` to the ``sandcell`` sub-command parsers."""
    files = commands.add_parser("files", help="list, fetch or upload a session's files")
    actions = files.add_subparsers(dest="files_action", required=True, metavar="ACTION")
    listing = actions.add_parser("ls", help="list a workspace directory")
    listing.add_argument("path", nargs="?", default="", help="a directory [the workspace root]")
    get = actions.add_parser("get", help="copy a workspace file out")
    get.add_argument("path", help="the file, relative to the workspace")
    get.add_argument("dest", nargs="?", help="where to write it [its base name here; - = stdout]")
    put = actions.add_parser("put", help="copy a local file into the workspace")
    put.add_argument("source", help="the local file")
    put.add_argument("path", nargs="?", help="where in the workspace [its base name]")
    for action in (listing, get, put):
        action.add_argument("--session", required=True, metavar="HINT", help="the session")


async def run_files(args: argparse.Namespace, settings: OrchestratorSettings, out: TextIO) -> int:
    """Run one ``files`` action; the exit code."""
    hint = hint_argument(args.session)
    session_id = runtime_session_id(CLI_NAMESPACE, os_user(), hint)
    upload = None
    if args.files_action == "put":
        try:
            upload = await asyncio.to_thread(Path(args.source).read_bytes)
        except OSError as exc:
            raise UsageError(f"{args.source}: {exc.strerror or exc}") from None
    async with open_services(settings, keep_warm=settings.distributed_registry) as services:
        try:
            return await _in_session(services, args, session_id, upload, out)
        except SessionBusyError:
            raise SessionBusyExit(
                f"session {hint!r} is busy: another call is running a turn in it;"
                " nothing was done (retry when that one has finished)"
            ) from None


async def _in_session(
    services: Services,
    args: argparse.Namespace,
    session_id: str,
    upload: bytes | None,
    out: TextIO,
) -> int:
    manager = services.manager
    async with manager.hold(session_id) as hold:
        attached = await manager.attach(hold, services.execution.spec)
        files = attached.handle.files
        if args.files_action == "ls":
            for entry in await files.list(args.path):
                out.write(f"{entry.kind:<7} {entry.size:>10}  {entry.name}\n")
        elif args.files_action == "get":
            data = await files.read_bytes(args.path)
            if args.dest == "-":
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            else:
                dest = Path(args.dest or Path(args.path).name)
                await asyncio.to_thread(dest.write_bytes, data)
                out.write(f"{args.path} -> {dest} ({len(data)} bytes)\n")
        else:
            assert upload is not None
            target = args.path or Path(args.source).name
            await files.write(target, upload)
            await manager.checkpoint(hold, attached)
            out.write(f"{args.source} -> {target} ({len(upload)} bytes)\n")
        if not services.execution.keep_warm:
            await manager.park(hold, attached)
    return 0
