"""``sandcell --help`` and ``--version``: what an operator meets first."""

from __future__ import annotations

import pytest

from sandcell_orchestrator.cli import main
from sandcell_protocol import PROTOCOL_VERSION


def test_version_names_the_package_and_the_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    """A bug report can quote both versions without reading pip's output."""
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("sandcell ")
    assert f"(protocol {PROTOCOL_VERSION})" in out


def test_help_shows_examples_settings_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert 'sandcell exec --session demo "print(6*7)"' in out
    assert "SANDCELL_*" in out
    assert "75 session" in out
    for command in ("exec", "run", "serve", "sessions", "files", "instances"):
        assert f"    {command}" in out
