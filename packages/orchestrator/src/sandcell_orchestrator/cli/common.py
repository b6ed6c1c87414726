"""What every ``sandcell`` command shares: the CLI's identity, errors and event loop."""

from __future__ import annotations

import argparse
import asyncio
import os
import pwd
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from sandcell_protocol import ProtocolError, validate_hint

__all__ = [
    "CLI_NAMESPACE",
    "CLI_STORAGE_SESSION",
    "EXIT_INTERRUPTED",
    "EXIT_SANDCELL_ERROR",
    "EXIT_SESSION_BUSY",
    "SessionBusyExit",
    "UsageError",
    "hint_argument",
    "os_user",
    "positive_float",
    "run_async",
]

T = TypeVar("T")

CLI_NAMESPACE = "cli"
"""The tenant namespace of every CLI session; the user id is the OS user name."""
CLI_STORAGE_SESSION = "cli"
"""Where ``--file`` inputs are kept in the input source (content-addressed)."""
EXIT_SANDCELL_ERROR = 2
EXIT_SESSION_BUSY = 75
"""EX_TEMPFAIL: the session was busy and the turn did not run; retrying may work."""
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A bad argument found after parsing (an unreadable file, an invalid hint)."""


class SessionBusyExit(Exception):
    """Another process holds the session: the turn did not run (exit 75)."""


def positive_float(raw: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def hint_argument(raw: str) -> str:
    """A ``--session`` value, validated as a runtime-session hint."""
    try:
        return validate_hint(raw)
    except ProtocolError:
        raise UsageError("--session: must be 1-128 of A-Z a-z 0-9 . _ : -") from None


def os_user() -> str:
    """The OS user name (the CLI's ``user_id``); the numeric uid if it has none."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def run_async(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
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
