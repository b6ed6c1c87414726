#!/usr/bin/env python3
"""CPU per spawn straight to the spawn helper: its vfork path (``_vfork.c``) against
its fork path, in alternating rounds.

Each round starts a helper of one kind, spawns ``/bin/true`` ``--count`` times in
turn (spawn, wait for the exit), and reads the helper's own CPU (``/proc/<pid>/stat``
utime + stime) and its children's (the rusage of each reaped child: what the child
did before its exec, the exec, and ``true``). The order alternates per pair of rounds
(vfork first, then fork first), because a shared machine's noise comes in phases.
CPU figures, not wall clock: the machine is shared.

Usage: .venv/bin/python scripts/bench_spawn.py [--count 500] [--pairs 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from sandcell_runner.jail.spawn_helper import SpawnHelper
from sandcell_runner.jail.spawner import SpawnRequest

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


async def _round(method: str, count: int) -> tuple[float, float]:
    """(helper CPU-ms, children CPU-ms) per spawn."""
    helper = SpawnHelper(vfork=method == "vfork")
    assert helper.spawn_method == method, f"asked for {method}, got {helper.spawn_method}"
    null = os.open(os.devnull, os.O_RDWR)
    request = SpawnRequest(
        argv=["/bin/true"], stdin=null, stdout=null, stderr=null, env={"PATH": "/usr/bin:/bin"}
    )
    try:
        for _ in range(20):  # warm-up: the helper's first spawns fault its code in
            await (await helper.spawn(request)).wait()
        assert helper.pid is not None
        before = _cpu_s(helper.pid)
        children = 0.0
        for _ in range(count):
            _, usage = await (await helper.spawn(request)).wait()
            assert usage is not None
            children += usage.ru_utime + usage.ru_stime
        own = _cpu_s(helper.pid) - before
    finally:
        helper.close()
        os.close(null)
    return own / count * 1000, children / count * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"vfork": [], "fork": []}
    for pair in range(args.pairs):
        order = ("vfork", "fork") if pair % 2 == 0 else ("fork", "vfork")
        for method in order:
            results[method].append(asyncio.run(_round(method, args.count)))
        (vh, vc), (fh, fc) = results["vfork"][-1], results["fork"][-1]
        print(
            f"pair {pair + 1}: vfork helper {vh:.3f} children {vc:.3f} | "
            f"fork helper {fh:.3f} children {fc:.3f} ms/spawn; "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    for method, rows in results.items():
        helper = statistics.median(row[0] for row in rows)
        children = statistics.median(row[1] for row in rows)
        print(
            f"{method:5}: helper {helper:.3f} ms, children {children:.3f} ms, "
            f"total {helper + children:.3f} ms per spawn (medians of {len(rows)} rounds)"
        )
    saved = [
        f[0] + f[1] - (v[0] + v[1]) for v, f in zip(results["vfork"], results["fork"], strict=True)
    ]
    print(
        "fork - vfork per pair: "
        + ", ".join(f"{d:.3f}" for d in saved)
        + f" ms (median {statistics.median(saved):.3f})"
    )


if __name__ == "__main__":
    main()
