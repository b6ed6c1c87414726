#!/usr/bin/env python3
"""The runner's own CPU per session turn, A against B (another tree) in one run.

bench_runner.py measures one-shot jobs without stdin; a session turn takes another
path: its job directory (``create_session_job_dir``) and, with stdin, the stdin
descriptor. This sends sequential session turns of ``bash: cat`` with a short
stdin to two session runners, A (this tree) and B (``--b-tree DIR``, a checkout of
another commit; without it B runs this tree too, an A/A check of the bias), in
alternating windows, and prints the runner process's own CPU (its threads, not its
children) per turn, each side's median, and B/A per round.

Usage: .venv/bin/python scripts/bench_session_turns.py [--rounds 10] [--turns 200]
       [--b-tree DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.paths import traversable_dir  # noqa: E402
from tests.fixtures.runner_process import start_runner, tree_python  # noqa: E402
from tests.runner.session.helpers import SessionClient  # noqa: E402


def own_cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--turns", type=int, default=200, help="turns per window")
    parser.add_argument("--b-tree", type=Path, metavar="DIR", help="B runs DIR's code")
    args = parser.parse_args()
    env = {"SANDCELL_RUNNER_SESSIONS": "1"}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    wall: dict[str, list[float]] = {"A": [], "B": []}
    with traversable_dir("bench-turns-") as base:
        b_python = tree_python(args.b_tree, base / "venv-b") if args.b_tree else sys.executable
        runners = {
            "A": start_runner(base / "a", env=env),
            "B": start_runner(base / "b", env=env, python=b_python),
        }
        try:
            clients = {side: SessionClient(runner) for side, runner in runners.items()}
            for client in clients.values():  # bound, warmed: pooled cgroups exist after this
                for _ in range(20):
                    assert client.execute("cat", language="bash", stdin="hi")["stdout"] == "hi"
            for n in range(args.rounds):
                for side in ("A", "B") if n % 2 == 0 else ("B", "A"):
                    pid = runners[side].process.pid
                    cpu_before, started = own_cpu_s(pid), time.monotonic()
                    for _ in range(args.turns):
                        result = clients[side].execute("cat", language="bash", stdin="hi")
                        assert result["stdout"] == "hi", result
                    cpu[side].append((own_cpu_s(pid) - cpu_before) / args.turns * 1000)
                    wall[side].append((time.monotonic() - started) / args.turns * 1000)
            for client in clients.values():
                client.close()
        finally:
            for runner in runners.values():
                runner.stop()
    print(f"B tree {args.b_tree or '- (A/A)'}; {args.rounds} rounds of {args.turns} turns")
    for side in ("A", "B"):
        rounds = " ".join(f"{x:.2f}" for x in cpu[side])
        print(
            f"{side} runner CPU {statistics.median(cpu[side]):.2f} ms/turn [{rounds}]"
            f"  wall {statistics.median(wall[side]):.2f} ms/turn"
        )
    ratios = [b / a for a, b in zip(cpu["A"], cpu["B"], strict=True)]
    print(
        f"B/A runner CPU per turn {statistics.median(ratios):.2f}x"
        f" [{min(ratios):.2f}-{max(ratios):.2f}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
