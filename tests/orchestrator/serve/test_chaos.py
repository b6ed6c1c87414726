"""``scripts/chaos.py --bounded`` (issue 20): two workers, one Redis, one S3, four sessions,
turns under every kind of fault; its invariants hold (nothing acknowledged lost, nothing
applied twice, no turn on an empty workspace, no runner left behind)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sandcell_orchestrator.testing import clean_environ

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "chaos.py"


def test_bounded_chaos_run_keeps_every_acknowledged_turn(tmp_path: Path) -> None:
    """The bounded run ends ok, with every fault kind injected and every turn acknowledged
    at least once per session at the end (its final read-back turns)."""
    report_path = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--bounded", "--json", str(report_path)],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert report_path.exists(), done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["ok"], json.dumps(report, indent=2)
    assert done.returncode == 0
    assert (report["lost"], report["duplicated"], report["empty_workspace"]) == (0, 0, 0)
    assert report["leftovers"] == 0
    assert len(report["faults"]) == 8  # stop_s3 included
    assert all(count >= 1 for count in report["faults"].values()), report["faults"]
    assert report["acknowledged"] >= 20
    assert report["given_up"] == 0, report["problems"]
