"""``sandcell sessions list|destroy``: the runtime sessions this user made."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any, TextIO

from sandcell_protocol import is_runtime_session_id, runtime_session_id

from ..bootstrap import open_services
from ..config import OrchestratorSettings
from .common import CLI_NAMESPACE, hint_argument, os_user
from .session_index import CliSessions

__all__ = ["add_parser", "run_destroy", "run_list"]


def add_parser(commands: Any) -> None:
    """Add ``sessions list|destroy`` to the ``sandcell`` sub-command parsers."""
    sessions = commands.add_parser("sessions", help="list or destroy runtime sessions")
    actions = sessions.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="list sessions")
    listing.add_argument("--json", action="store_true", help="print JSON")
    destroy = actions.add_parser("destroy", help="destroy a session, its sandbox and checkpoint")
    destroy.add_argument("session", metavar="ID", help="an rt_… id, or a hint given to exec")


async def run_list(args: argparse.Namespace, settings: OrchestratorSettings, out: TextIO) -> int:
    entries = await asyncio.to_thread(CliSessions(settings.home).entries)
    rows: list[dict[str, Any]] = []
    async with open_services(settings) as services:
        records = {r.session_id: r for r in await services.execution.list_sessions()}
        for session_id in sorted(set(records) | set(entries)):
            record = records.get(session_id)
            entry = entries.get(session_id, {})
            saved = await services.manager.current_checkpoint(session_id) is not None
            # Without a registry record (a registry wiped or moved) a session lives
            # on as its checkpoint only.
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


async def run_destroy(args: argparse.Namespace, settings: OrchestratorSettings, out: TextIO) -> int:
    raw: str = args.session
    session_id = (
        raw
        if is_runtime_session_id(raw)
        else runtime_session_id(CLI_NAMESPACE, os_user(), hint_argument(raw))
    )
    async with open_services(settings) as services:
        had_checkpoint = await services.manager.current_checkpoint(session_id) is not None
        # A session a serving surface indexed has its owner in the store as well
        # (``sessions/owners.py``): without this its listing would outlive it.
        owner = await services.owners.index.session_owner(session_id)
        had_record = await services.execution.destroy_session(session_id)
        if owner is not None:
            await services.owners.forget(owner.namespace, session_id)
    listed = await asyncio.to_thread(CliSessions(settings.home).remove, session_id)
    if not (had_checkpoint or had_record or listed):
        sys.stderr.write(f"sandcell: no session {raw}\n")
        return 1
    out.write(f"destroyed {session_id}\n")
    return 0
