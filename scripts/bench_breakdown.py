#!/usr/bin/env python3
"""Where the CPU of one execution goes: the runner's tree by component, against raw nsjail.

``bench_runner.py`` gives the whole tree's CPU per execution (cpuacct); this splits
it, one client at a time (the 1-client figures; 16 clients only add contention):

  runner      the runner process itself, all threads (``/proc/<pid>/stat`` utime, stime)
  spawnd      the resident spawn helper itself (its own utime, stime)
  nsjail+job  what the helper's reaped children used (its cutime, cstime): nsjail,
              the jail set-up in nsjail's clone before exec, and the job itself
  kthreads    CPU of kernel threads during the window (all of them: noisy on a
              shared machine; compare with the idle window printed with it)

and runs raw nsjail in variants that each add one thing the runner's jobs do and
the plain baseline of ``bench_runner.py`` does not (nsjail started as the job's
UID, the job in a memory+pids cgroup, nsjail's INFO log into a pipe), so the
difference between the raw baseline and the runner's nsjail+job is explained
flag by flag. Raw figures: this process's own CPU while spawning (the helper's
analogue: Python's fork+exec) and its children's (nsjail+job).

``--perf`` also records the runner's tree with ``perf record`` (cpu-clock, call
graphs, inherited by children) and prints the top symbols per command.

``--b-tree DIR`` also runs a runner of DIR's code (``git archive <commit> packages |
tar -x -C DIR``), its windows right after this tree's: a lever's A/B by component.

Usage: .venv/bin/python scripts/bench_breakdown.py [--count 300] [--rounds 3] [--perf]
       [--b-tree DIR]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import httpx  # noqa: E402
from bench_runner import RawJail, kthreads_by_pid, tree  # noqa: E402
from tests.fixtures.paths import traversable_dir  # noqa: E402
from tests.fixtures.runner_process import RunnerProcess, start_runner, tree_python  # noqa: E402

from sandcell_runner.jail.cgroups import CgroupManager  # noqa: E402
from sandcell_runner.languages import discover_languages  # noqa: E402

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def stat(pid: int) -> tuple[float, float, float, float]:
    """(utime, stime, cutime, cstime) of ``pid`` in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return tuple(int(fields[i]) * TICK_MS for i in (11, 12, 13, 14))  # type: ignore[return-value]


KTHREADS: collections.Counter[str] = collections.Counter()
"""Per kernel-thread name (digits dropped), CPU ms summed over the windows of the current label."""


class Kthreads:
    """Kernel-thread CPU over a window, total and by name (into ``BY_LABEL``)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.before = kthreads_by_pid()

    def done(self) -> float:
        delta: collections.Counter[str] = collections.Counter()
        for pid, (name, ms) in kthreads_by_pid().items():
            delta[name] += ms - self.before.get(pid, (name, 0.0))[1]
        BY_LABEL.setdefault(self.label, collections.Counter()).update(delta)
        return sum(delta.values())


BY_LABEL: dict[str, collections.Counter[str]] = {}


def set_uids(libc: ctypes.CDLL, uid: int, *, saved: int) -> None:
    """This thread's credentials only (raw syscalls; glibc's wrappers change every thread)."""
    for number, args in ((_SYS_SETRESGID, (uid, uid, saved)), (_SYS_SETRESUID, (uid, uid, saved))):
        if libc.syscall(number, *args) != 0:
            raise OSError(ctypes.get_errno(), "setres*id")


_SYS_SETGROUPS, _SYS_SETRESUID, _SYS_SETRESGID = 116, 117, 119  # x86_64


def row(name: str, count: int, values: dict[str, float]) -> str:
    cells = "  ".join(f"{k} {v / count:6.2f}" for k, v in values.items())
    return f"  {name:<28} {cells}  (ms CPU per exec, n={count})"


def raw_variant(
    raw: RawJail,
    argv: list[str],
    *,
    count: int,
    label: str,
    as_uid: bool,
    cgroup: list[Path] | None,
    info_log: bool,
) -> dict[str, float]:
    config = raw.config(0)
    text = config.read_text()
    if info_log:
        config.write_text(text.replace("log_level: ERROR", "log_level: INFO"))
    result: dict[str, float] = {}

    def work() -> None:
        if cgroup is not None:
            for tasks in cgroup:  # this thread moves itself: its children start there
                tasks.write_text("0")
        log_r, log_w = os.pipe()
        drained = threading.Thread(
            target=lambda: [None for _ in iter(lambda: os.read(log_r, 65536), b"")]
        )
        drained.start()
        libc = ctypes.CDLL(None, use_errno=True)
        groups = os.getgroups()
        if as_uid:
            # As the runner's helper does, but without a fork of this big process
            # (subprocess's user= gives up vfork): this thread alone becomes the
            # job's UID, keeping root as its saved UID to come back.
            if libc.syscall(_SYS_SETGROUPS, 0, None) != 0:
                raise OSError(ctypes.get_errno(), "setgroups")
            set_uids(libc, raw.uid, saved=0)

        def once() -> None:
            subprocess.run(
                [str(raw.nsjail), "--log_fd", str(log_w), "--config", str(config), "--", *argv],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=[log_w],
            )

        for _ in range(5):
            once()
        before_self = time.thread_time()
        before = os.times()
        kthreads = Kthreads(label)
        for _ in range(count):
            once()
        after = os.times()
        result["self"] = (time.thread_time() - before_self) * 1000
        result["nsjail+job"] = (
            after.children_user
            + after.children_system
            - before.children_user
            - before.children_system
        ) * 1000
        result["child_sys"] = (after.children_system - before.children_system) * 1000
        result["kthreads"] = kthreads.done()
        if as_uid:
            set_uids(libc, 0, saved=0)
            array = (ctypes.c_uint * len(groups))(*groups)
            libc.syscall(_SYS_SETGROUPS, len(groups), array)
        os.close(log_w)
        drained.join()
        os.close(log_r)
        if cgroup is not None:
            for tasks in cgroup:
                parent = tasks.parent.parent / "tasks"
                parent.write_text("0")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    config.write_text(text)
    return result


def runner_window(
    url: str,
    token: str,
    body: dict[str, object],
    *,
    count: int,
    label: str,
    pids: tuple[int, int],
) -> dict[str, float]:
    runner_pid, helper_pid = pids
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
        for _ in range(5):
            c.post("/v1/execute", json=body).raise_for_status()
        r0, h0 = stat(runner_pid), stat(helper_pid)
        kthreads = Kthreads(label)
        for _ in range(count):
            answer = c.post("/v1/execute", json=body)
            answer.raise_for_status()
            assert answer.json()["status"] == "ok", answer.text
        r1, h1 = stat(runner_pid), stat(helper_pid)
    return {
        "runner": r1[0] + r1[1] - r0[0] - r0[1],
        "runner_sys": r1[1] - r0[1],
        "spawnd": h1[0] + h1[1] - h0[0] - h0[1],
        "nsjail+job": h1[2] + h1[3] - h0[2] - h0[3],
        "child_sys": h1[3] - h0[3],
        "kthreads": kthreads.done(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--perf", action="store_true")
    parser.add_argument("--b-tree", type=Path, metavar="DIR", help="also a runner of DIR's code")
    args = parser.parse_args()
    bash = discover_languages()["bash"].binary
    python = discover_languages()["python"].binary
    argvs = {"true": [bash, "-c", "true"], "python": [python, "-c", "pass"]}
    bodies: dict[str, dict[str, object]] = {
        "true": {"language": "bash", "code": "true"},
        "python": {"language": "python", "code": "pass"},
    }
    with traversable_dir("breakdown-") as base:
        raw_dir = base / "raw"
        raw_dir.mkdir(mode=0o711)
        raw = RawJail(raw_dir)
        cgroups = CgroupManager("bench-breakdown")
        group = cgroups.create("raw", memory_bytes=512 << 20, pids=64)
        tasks = group.thread_join_paths()
        env = {"SANDCELL_RUNNER_MAX_JOBS": "64"}
        runners = {"runner": start_runner(base / "runner", env=env)}
        try:
            if args.b_tree is not None:
                python = tree_python(args.b_tree, base / "venv-b")
                runners["runner B"] = start_runner(base / "runner-b", env=env, python=python)
            pids: dict[str, tuple[int, int]] = {}
            for side, runner in runners.items():
                with httpx.Client(base_url=runner.url, timeout=60) as c:
                    for body in bodies.values():
                        answer = c.post("/v1/execute", json=body, headers=runner.headers())
                        answer.raise_for_status()
                helper = [
                    p
                    for p in tree(runner.process.pid)
                    if b"spawnd.py" in Path(f"/proc/{p}/cmdline").read_bytes()
                ]
                assert len(helper) == 1, helper
                pids[side] = (runner.process.pid, helper[0])
                print(f"{side}: runner pid {pids[side][0]}, spawnd pid {pids[side][1]}")
            variants = {
                "raw (bench_runner baseline)": {"as_uid": False, "cgroup": None, "info_log": False},
                "raw +as job uid": {"as_uid": True, "cgroup": None, "info_log": False},
                "raw +uid +cgroup": {"as_uid": True, "cgroup": tasks, "info_log": False},
                "raw +uid +cgroup +INFO log": {"as_uid": True, "cgroup": tasks, "info_log": True},
            }
            results: dict[tuple[str, str], list[dict[str, float]]] = {}
            idle: list[float] = []
            for _ in range(args.rounds):
                window = Kthreads("idle")
                time.sleep(2)
                idle.append(window.done() / 2)
                for name, argv in argvs.items():
                    for label, options in variants.items():
                        results.setdefault((name, label), []).append(
                            raw_variant(
                                raw, argv, count=args.count, label=f"{name} {label}", **options
                            )  # type: ignore[arg-type]
                        )
                    for side, runner in runners.items():
                        results.setdefault((name, side), []).append(
                            runner_window(
                                runner.url,
                                runner.token,
                                bodies[name],
                                count=args.count,
                                label=f"{name} {side}",
                                pids=pids[side],
                            )
                        )
            idle_ms = statistics.median(idle)
            print(f"load {os.getloadavg()[0]:.1f}; kernel threads idle {idle_ms:.1f} ms/s")
            for name in argvs:
                print(f"{name}: median of {args.rounds} rounds")
                for (kind, label), windows in results.items():
                    if kind != name:
                        continue
                    keys = windows[0].keys()
                    medians = {k: statistics.median(w[k] for w in windows) for k in keys}
                    print(row(label, args.count, medians))
            print("kernel threads by name, ms per exec (idle: ms per second)")
            for label, counter in BY_LABEL.items():
                per = 2 * args.rounds if label == "idle" else args.count * args.rounds
                top = ", ".join(f"{k} {v / per:.2f}" for k, v in counter.most_common(6) if v > 0)
                print(f"  {label:<40} {top}")
            if args.perf:
                record(runners["runner"], pids["runner"], bodies["true"], count=args.count)
        finally:
            for runner in runners.values():
                runner.stop()
            group.destroy()
            cgroups.release_all()
    return 0


def record(
    runner: RunnerProcess, pids: tuple[int, int], body: dict[str, object], *, count: int
) -> None:
    data = Path("/tmp") / f"breakdown-{os.getpid()}.perf"
    perf = subprocess.Popen(
        ["perf", "record", "-F", "4000", "-g", "-o", str(data), "-p", f"{pids[0]},{pids[1]}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1)
    runner_window(
        runner.url,
        runner.token,
        body,
        count=count,
        label="perf",
        pids=pids,
    )  # type: ignore[attr-defined]
    perf.send_signal(2)
    perf.wait()
    print(f"perf data: {data}")
    out = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--sort", "comm", "--stdio"],
        capture_output=True,
        text=True,
    ).stdout
    print("\n".join(line for line in out.splitlines() if line and not line.startswith("#"))[:3000])


if __name__ == "__main__":
    raise SystemExit(main())
