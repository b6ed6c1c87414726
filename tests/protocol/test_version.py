"""Version compatibility and the pins that keep runner and orchestrator in step."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import requires
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest

import sandcell_protocol
from sandcell_protocol import PROTOCOL_VERSION, ProtocolMismatchError, check_compatible

ROOT = Path(__file__).resolve().parents[2]


def test_protocol_version() -> None:
    assert PROTOCOL_VERSION == "1.3"


@pytest.mark.parametrize("peer", ["1.0", "1.7", "1.99"])
def test_compatible_minors(peer: str) -> None:
    check_compatible(peer)


@pytest.mark.parametrize("peer", ["2.0", "0.9", "garbage", ""])
def test_incompatible_majors(peer: str) -> None:
    with pytest.raises(ProtocolMismatchError) as info:
        check_compatible(peer)
    assert PROTOCOL_VERSION in str(info.value)


def test_mismatch_names_both_versions() -> None:
    with pytest.raises(ProtocolMismatchError, match=r"1\.3.*2\.0"):
        check_compatible("2.0")


@pytest.mark.parametrize("member", ["runner", "orchestrator"])
def test_sides_pin_exact_protocol_version(member: str) -> None:
    """Both sides depend on sandcell-protocol==<this package's own version>."""
    protocol_version = tomllib.loads(
        (ROOT / "packages/protocol/pyproject.toml").read_text(encoding="utf-8")
    )["project"]["version"]
    deps = tomllib.loads((ROOT / f"packages/{member}/pyproject.toml").read_text(encoding="utf-8"))[
        "project"
    ]["dependencies"]
    pins = [d.replace(" ", "") for d in deps if d.replace(" ", "").startswith("sandcell-protocol")]
    assert pins == [f"sandcell-protocol=={protocol_version}"]
    installed = requires(f"sandcell-{member}") or []
    assert f"sandcell-protocol=={protocol_version}" in [r.replace(" ", "") for r in installed]
    assert dist_version("sandcell-protocol") == protocol_version == sandcell_protocol.__version__


@pytest.mark.parametrize(
    ("module", "dist"),
    [
        ("sandcell_protocol", "sandcell-protocol"),
        ("sandcell_runner", "sandcell-runner"),
        ("sandcell_orchestrator", "sandcell-orchestrator"),
    ],
)
def test_version_constants_match_distributions(module: str, dist: str) -> None:
    assert __import__(module).__version__ == dist_version(dist)


def test_schema_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sandcell_protocol", "schema"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert '"ExecuteRequest"' in out
    assert '"x-sandcell-protocol": "1.3"' in out
