"""Whether a runner can plumb egress links is read from what it holds, not assumed from root."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sandcell_runner.egress.manager import EgressManager
from sandcell_runner.egress.plumbing import tools_missing
from sandcell_runner.egress.settings import EgressSettings
from sandcell_runner.jail.capabilities import effective_capabilities

# What a container's root holds under the engine's defaults plus SYS_ADMIN (podman):
# no CAP_NET_ADMIN (bit 12).
_SYS_ADMIN_ONLY = 0x00000000A82425FB | (1 << 21)


def _status(tmp_path: Path, cap_eff: int) -> Path:
    path = tmp_path / "status"
    path.write_text(f"Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff:016x}\n")
    return path


def test_a_missing_net_admin_is_named(tmp_path: Path) -> None:
    """Root in a container without CAP_NET_ADMIN: the reason says which capability."""
    status = _status(tmp_path, _SYS_ADMIN_ONLY & ~(1 << 12))
    assert effective_capabilities(status) & (1 << 21)
    reason = tools_missing(status=status)
    assert reason is not None
    assert "CAP_NET_ADMIN" in reason


def test_a_missing_sys_admin_is_named(tmp_path: Path) -> None:
    status = _status(tmp_path, (1 << 12))
    reason = tools_missing(status=status)
    assert reason is not None
    assert "CAP_SYS_ADMIN" in reason


def test_this_runner_can(tmp_path: Path) -> None:
    """The tests' runner (root on this host, ip and nft installed) has what it needs."""
    assert tools_missing() is None
    assert effective_capabilities() & (1 << 12)


def test_a_runner_that_cannot_says_why_in_its_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``/health`` says only ``none``; the start-up log carries the reason."""
    manager = EgressManager(
        EgressSettings(), unavailable="egress needs CAP_NET_ADMIN (test)", state_dir=tmp_path
    )
    with caplog.at_level(logging.INFO, logger="sandcell_runner.egress.manager"):
        manager.start()
    assert manager.mechanism == "none"
    assert "egress needs CAP_NET_ADMIN (test)" in caplog.text
    manager.close()
