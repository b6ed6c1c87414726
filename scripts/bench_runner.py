#!/usr/bin/env python3
"""Benchmark the runner against raw nsjail, in one run, on this machine.

(a) raw `nsjail … /bin/true` with the runner's own configuration: spawn-and-wait p50/p99
(b) POST /v1/execute `bash: true` through the runner, one client (wrk): p50/p99
(c) the same for `python: pass` against raw jailed `python3 -c pass`
(d) executions per second at 1, 4 and 16 clients against the raw jail's parallel ceiling

Figures are ratios against baselines measured in the same run, because these
machines are noisy. Load comes from Debian's `wrk` (installed if missing): an
httpx client saturates near 300-500 requests/s and would measure itself.

Usage: .venv/bin/python scripts/bench_runner.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.paths import traversable_dir  # noqa: E402
from tests.fixtures.runner_process import start_runner  # noqa: E402

from sandcell_runner.cgroups import CgroupManager  # noqa: E402
from sandcell_runner.config import RunnerSettings  # noqa: E402
from sandcell_runner.jail import Jail  # noqa: E402
from sandcell_runner.job_spec import JobLimits, JobSpec  # noqa: E402
from sandcell_runner.languages import discover_languages  # noqa: E402

WRK_LUA = """
wrk.method = "POST"
wrk.body = os.getenv("BENCH_BODY")
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_TOKEN")
done = function(summary, latency, requests)
  io.write(string.format("JSON{\\"p50\\":%f,\\"p99\\":%f,\\"requests\\":%d,\\"errors\\":%d,"
    .. "\\"non2xx\\":%d,\\"seconds\\":%f}\\n",
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, summary.requests,
    summary.errors.connect + summary.errors.read + summary.errors.write
      + summary.errors.timeout, summary.errors.status, summary.duration / 1e6))
end
"""


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    subprocess.run(["apt-get", "update", "-q"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "wrk"],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )
    return shutil.which("wrk") or "wrk"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class RawJail:
    """nsjail with exactly the runner's configuration, spawned directly."""

    def __init__(self, root: Path) -> None:
        settings = RunnerSettings.from_env({"SANDCELL_RUNNER_INSECURE_NO_AUTH": "1"})
        assert settings.nsjail_path is not None
        self.nsjail = settings.nsjail_path
        self.jail = Jail(nsjail=self.nsjail, cgroups=CgroupManager("bench-raw"), spawner=None)  # type: ignore[arg-type]
        self.root = root
        self.uid = 20_999
        limits = settings.limits
        self.limits = JobLimits(
            timeout_ms=30_000,
            memory_bytes=limits.memory_mib << 20,
            pids=limits.pids,
            stdout_bytes=limits.stdout_bytes,
            stderr_bytes=limits.stderr_bytes,
            file_size_mib=limits.file_size_mib,
            open_files=limits.open_files,
            tmp_mib=limits.tmp_mib,
        )

    def config(self, index: int) -> Path:
        workspace = self.root / f"ws{index}"
        job = self.root / f"job{index}"
        for directory in (workspace, job):
            directory.mkdir(exist_ok=True)
            os.chown(directory, self.uid, self.uid)
        spec = JobSpec(
            argv=["/bin/true"],
            workspace=workspace,
            job_dir=job,
            uid=self.uid,
            gid=self.uid,
            env={"PATH": "/usr/bin:/bin"},
            limits=self.limits,
        )
        path = self.root / f"job{index}.cfg"
        path.write_text(self.jail.config_text(spec).replace("log_level: INFO", "log_level: ERROR"))
        return path

    def run_once(self, config: Path, argv: list[str]) -> float:
        started = time.perf_counter()
        subprocess.run(
            [str(self.nsjail), "--config", str(config), "--", *argv],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return (time.perf_counter() - started) * 1000

    def latency(self, argv: list[str], *, count: int) -> list[float]:
        config = self.config(0)
        for _ in range(5):
            self.run_once(config, argv)
        return [self.run_once(config, argv) for _ in range(count)]

    def ceiling(self, argv: list[str], *, workers: int, seconds: float) -> float:
        configs = [self.config(i) for i in range(workers)]
        counts = [0] * workers
        deadline = time.monotonic() + seconds

        def work(i: int) -> None:
            while time.monotonic() < deadline:
                self.run_once(configs[i], argv)
                counts[i] += 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(counts) / (time.monotonic() - started)


def wrk(
    binary: str, url: str, token: str, body: dict[str, object], *, clients: int, seconds: float
) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_LUA)
    try:
        out = subprocess.run(
            [
                binary,
                f"-t{min(clients, 2)}",
                f"-c{clients}",
                f"-d{max(1, round(seconds))}s",
                "--timeout",
                "30s",
                "-s",
                script.name,
                url + "/v1/execute",
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "BENCH_BODY": json.dumps(body), "BENCH_TOKEN": token},
        ).stdout
    finally:
        os.unlink(script.name)
    match = re.search(r"JSON(\{.*\})", out)
    assert match, out
    figures: dict[str, float] = json.loads(match.group(1))
    figures["rps"] = figures["requests"] / figures["seconds"]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    binary = ensure_wrk()
    python = discover_languages()["python"].binary
    with traversable_dir("bench-") as base:
        raw_dir = base / "raw"
        raw_dir.mkdir(mode=0o711)
        raw = RawJail(raw_dir)
        raw_true = raw.latency(["/bin/true"], count=args.count)
        raw_python = raw.latency([python, "-c", "pass"], count=args.count)
        raw_ceiling_true = raw.ceiling(["/bin/true"], workers=16, seconds=args.seconds)
        raw_ceiling_python = raw.ceiling([python, "-c", "pass"], workers=16, seconds=args.seconds)
        runner = start_runner(base / "runner", env={"SANDCELL_RUNNER_MAX_JOBS": "64"})
        try:
            bodies = {
                "true": {"language": "bash", "code": "true"},
                "python": {"language": "python", "code": "pass"},
            }
            one = {
                name: wrk(binary, runner.url, runner.token, body, clients=1, seconds=args.seconds)
                for name, body in bodies.items()
            }
            load = {
                (name, clients): wrk(
                    binary, runner.url, runner.token, body, clients=clients, seconds=args.seconds
                )
                for name, body in bodies.items()
                for clients in (1, 4, 16)
            }
        finally:
            runner.stop()

    def row(label: str, value: float, base_value: float, unit: str = "ms") -> None:
        print(f"  {label:<44} {value:8.2f} {unit:<5} {value / base_value:5.2f}x")

    print("(a) raw jail spawn-and-wait (runner's own nsjail configuration)")
    print(
        f"  /bin/true      p50 {statistics.median(raw_true):.2f} ms  p99 "
        f"{percentile(raw_true, 99):.2f} ms"
    )
    print(
        f"  python -c pass p50 {statistics.median(raw_python):.2f} ms  p99 "
        f"{percentile(raw_python, 99):.2f} ms"
    )
    print("(b) POST /v1/execute bash:true, one client (ratio vs (a))")
    row("p50", one["true"]["p50"], statistics.median(raw_true))
    row("p99", one["true"]["p99"], percentile(raw_true, 99))
    print("(c) POST /v1/execute python:pass, one client (ratio vs raw python -c pass)")
    row("p50", one["python"]["p50"], statistics.median(raw_python))
    row("p99", one["python"]["p99"], percentile(raw_python, 99))
    print("(d) executions/s (ratio vs the raw jail's 16-way parallel ceiling)")
    print(f"  raw ceiling true {raw_ceiling_true:.1f}/s, python {raw_ceiling_python:.1f}/s")
    for (name, clients), figures in load.items():
        ceiling = raw_ceiling_true if name == "true" else raw_ceiling_python
        errors = int(figures["errors"] + figures["non2xx"])
        row(f"{name:<6} {clients:>2} clients (errors {errors})", figures["rps"], ceiling, "/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
