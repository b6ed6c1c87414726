"""nsjail's log is read once nsjail has exited, and a chatty nsjail still never stalls.

``Jail`` widens the log pipe to a megabyte and drains it after the exit (one read
instead of a wake-up per line). The most a configuration under the runner's cap
(60 KB) makes nsjail log, ~150 bytes a mount, must still end at once, the job's
status read from the log's last line; so must it where the pipe cannot grow (the
log is then drained as it comes).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.jail import nsjail as nsjail_module
from sandcell_runner.jail.nsjail import Jail
from sandcell_runner.jail.spec import JobSpec
from tests.runner.jail.real_jail import real_jail, shell_job

UID = 61_236


@pytest.fixture
def jail_root() -> Iterator[tuple[Jail, Path]]:
    with real_jail("jail-log-") as (jail, _, root):
        yield jail, root


def _spec(root: Path, script: str, *, binds: int = 0) -> JobSpec:
    spec = shell_job(root / "ws", root / "job", script, uid=UID)
    # Each read-only bind is a "Mount: ..." line of nsjail's log (~150 bytes).
    source = root / "shared"
    source.mkdir()
    long_name = "d" * 40
    return dataclasses.replace(
        spec,
        readonly_binds=tuple((source, f"/mnt/{long_name}{index}") for index in range(binds)),
    )


@pytest.mark.parametrize("widened", [True, False])
def test_the_longest_log_does_not_stall_the_job(
    jail_root: tuple[Jail, Path], monkeypatch: pytest.MonkeyPatch, widened: bool
) -> None:
    jail, root = jail_root
    if not widened:
        monkeypatch.setattr(nsjail_module, "widen", lambda fd: False)
    spec = _spec(root, "exit 3", binds=330)
    assert 50_000 < len(jail.config_text(spec)) < 60_000  # just under the runner's cap

    outcome = asyncio.run(jail.run(spec))

    # A stalled nsjail (blocked on a full log pipe) would be killed at the 20 s
    # timeout: the job's own exit status and no timeout say it never stalled, on
    # a loaded machine too (a wall-clock bound here would be a timing test).
    assert (outcome.exit_code, outcome.signal) == (3, None), outcome.jail_log
    assert not outcome.timed_out


def test_the_jails_own_status_line_is_read_after_the_exit(jail_root: tuple[Jail, Path]) -> None:
    """A fault's signal is told from an exit status by the log's last line."""
    jail, root = jail_root
    fault = "exec /usr/bin/python3 -c 'import ctypes; ctypes.string_at(0)'"
    outcome = asyncio.run(jail.run(_spec(root, fault)))
    assert (outcome.exit_code, outcome.signal) == (None, "SIGSEGV"), outcome.jail_log
