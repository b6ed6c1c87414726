"""How a sandbox process's events reach its streams, and how its end is reported.

``Subscriber``: one stream's bounded queue of events; one that falls
``SANDCELL_RUNNER_PROCESS_STREAM_EVENTS`` (``QUEUE_EVENTS`` by default) behind is
dropped (its stream ends, with ``dropped_note`` saying why) rather than buffered
without bound. ``ended``: the ``ProcessEnded`` of a process from the init's
report (``exit N`` / ``signal N``) or, when the init could not say, from what
the jail saw; statuses read like envd's (``exit status 1``, ``signal: killed``).
"""

from __future__ import annotations

import asyncio
import signal

from sandcell_protocol import sandbox_messages as sm

from ..jail.launched import LaunchOutcome
from ..jail.outcome import signal_name
from ..session_process import Report

QUEUE_EVENTS = 256
SIGNALS = {
    "SIGTERM": signal.SIGTERM,
    "SIGKILL": signal.SIGKILL,
    "SIGINT": signal.SIGINT,
    "SIGHUP": signal.SIGHUP,
    "SIGQUIT": signal.SIGQUIT,
    "SIGUSR1": signal.SIGUSR1,
    "SIGUSR2": signal.SIGUSR2,
}
_STATUS_OF_SIGNAL = {
    "SIGKILL": "signal: killed",
    "SIGTERM": "signal: terminated",
    "SIGINT": "signal: interrupt",
    "SIGHUP": "signal: hangup",
}


class Subscriber:
    """One stream's view of a process: a bounded queue; ``None`` ends it."""

    def __init__(self, limit: int = QUEUE_EVENTS) -> None:
        self.limit = limit
        self.queue: asyncio.Queue[sm.ProcessEvent | None] = asyncio.Queue(limit + 1)
        self.dropped = False

    def offer(self, event: sm.ProcessEvent | None) -> bool:
        """Queue ``event``; False (and the stream ends) if this subscriber fell behind."""
        if self.dropped:
            return False
        if event is not None and self.queue.qsize() >= self.limit:
            self.dropped = True
            self.queue.put_nowait(None)
            return False
        self.queue.put_nowait(event)
        return True


def dropped_note(limit: int) -> str:
    """Why a dropped stream ended: the limit and the setting that raises it (the user
    sees it as the end's ``error`` and, last on stderr, in the output itself)."""
    return (
        f"sandcell: this stream fell {limit} output chunks behind the process and was"
        " ended; the process keeps running (read its output faster, send it to a file,"
        " or raise SANDCELL_RUNNER_PROCESS_STREAM_EVENTS)"
    )


def ended(sent: str | None, outcome: LaunchOutcome | None, report: Report) -> sm.ProcessEnded:
    exit_code, signum = report
    error = None
    if exit_code is None and signum is None:
        if outcome is None or (outcome.jail_failed and sent == "SIGKILL"):
            signum = int(signal.SIGKILL)
        elif outcome.jail_failed:
            error = "the jail could not run the process: " + outcome.jail_log[-400:]
            exit_code = outcome.exit_code if outcome.exit_code is not None else -1
        else:
            exit_code = outcome.exit_code
            name = outcome.signal
            signum = int(SIGNALS[name]) if name in SIGNALS else None
    if outcome is not None and outcome.oom_killed:
        error = "killed: memory limit reached"
    if signum is not None:
        name = signal_name(signum) or f"signal {signum}"
        status = _STATUS_OF_SIGNAL.get(name, f"signal: {name}")
        return sm.ProcessEnded(exit_code=None, signal=name, status=status, error=error)
    code = exit_code if exit_code is not None else -1
    return sm.ProcessEnded(exit_code=code, status=f"exit status {code}", error=error)


__all__ = ["QUEUE_EVENTS", "SIGNALS", "Subscriber", "dropped_note", "ended"]
