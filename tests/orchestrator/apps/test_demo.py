"""scripts/app-demo: creates an instance from a template and prints its preview URL."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sandcell_orchestrator.testing import clean_environ

ROOT = Path(__file__).resolve().parents[3]


def test_app_demo_prints_a_preview_url_that_serves(tmp_path: Path, runtime_dir: Path) -> None:
    env = clean_environ(
        SANDCELL_HOME=str(tmp_path / "home"), SANDCELL_LOCAL_RUNTIME_DIR=str(runtime_dir)
    )
    done = subprocess.run(
        [str(ROOT / "scripts" / "app-demo"), "static-site", "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (url,) = done.stdout.split()
    assert url.startswith("http://127.0.0.1:")
    assert "/preview/app_" in url
    assert "?token=" in url
    assert "preview answered HTTP 200" in done.stderr
