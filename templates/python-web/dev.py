"""Dev server: run app.py, restart it when a source file changes.

Polls modification times (no dependencies, works on any filesystem) and stops
the child on SIGTERM so the sandbox's process control reaches the app too.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WATCHED = (".py", ".html", ".css", ".js", ".json")
POLL_S = 0.3


def snapshot() -> dict[str, float]:
    stamps = {}
    for path in HERE.rglob("*"):
        if path.suffix in WATCHED and ".git" not in path.parts and path.is_file():
            with contextlib.suppress(OSError):  # deleted while walking
                stamps[str(path)] = path.stat().st_mtime_ns
    return stamps


def start() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-u", str(HERE / "app.py")], cwd=HERE)


def main() -> None:
    child = start()

    def stop(*_: object) -> None:
        child.terminate()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    seen = snapshot()
    while True:
        time.sleep(POLL_S)
        now = snapshot()
        if now != seen:
            seen = now
            print("[dev] change detected; restarting app.py", flush=True)
            child.terminate()
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            # A crashed app (a syntax error, say) stays down until the next change.
            child = start()


if __name__ == "__main__":
    main()
