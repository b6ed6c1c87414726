#!/usr/bin/env python3
"""Benchmark the orchestrator's overhead on the local provider, in one run.

- warm-session execute through ExecutionService vs a direct RunnerClient execute on
  the same runner (a turn that changes nothing; and the checkpoint's share of one
  that changes a file)
- cold session to first result (launch + execute, no restore): p50 / p95
- acquire from the warm pool (SANDCELL_LOCAL_POOL_SIZE), and a cold session to first
  result whose sandbox comes from it
- restore of a 200 MiB workspace on top of a turn
- per-turn checkpoint time and bytes

Usage: .venv/bin/python scripts/bench_orchestrator.py [--turns 40]
       .venv/bin/python scripts/bench_orchestrator.py --cold-only 20 [--env NAME=VALUE ...]

``--cold-only N``: only the cold rows, N sessions, with the CPU each start cost (the
whole process tree's: this process, its runners, their helpers, a zygote), and the
CPU time of a fixed loop (``speed_probe_ms``) run before each session: on this kind of
machine (2 vCPUs of a shared host) it swings between ~9.5 and ~18 ms from one second
to the next, whatever this machine runs, and every CPU and latency figure with it. A
run whose probe p50 is high ran on a slow host; compare A/B rounds by it. A
``PYTHONPATH`` in the environment reaches the runners too, so an A/B against another
tree's packages (``PYTHONPATH=/other/packages/orchestrator/src:...``) runs its runner.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from tests.fixtures.paths import traversable_dir  # noqa: E402

from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings  # noqa: E402
from sandcell_orchestrator.registry import InProcessRegistry  # noqa: E402
from sandcell_orchestrator.sessions.execution import ExecutionService, Identity  # noqa: E402
from sandcell_orchestrator.snapshots import DirectorySnapshotStore  # noqa: E402
from sandcell_protocol import ExecuteRequest, checkpoint_key, runtime_session_id  # noqa: E402

WHO = Identity("bench", "user")
NOOP = ExecuteRequest(language="python", code="pass")
BIG = ExecuteRequest(
    language="python",
    code=(
        "import os\n"
        "for i in range(100):\n"
        "    open(f'f{i}.bin', 'wb').write(os.urandom(2 * 1024 * 1024))\n"
    ),
    timeout_ms=120_000,
    limits=None,
)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def timed(coro: object) -> float:
    started = time.perf_counter()
    await coro  # type: ignore[misc]
    return (time.perf_counter() - started) * 1000


async def main(turns: int, settings: dict[str, bool]) -> None:
    with traversable_dir("benchorch-") as root:
        store = DirectorySnapshotStore(root / "snapshots")
        env = {"SANDCELL_RUNNER_WORKSPACE_QUOTA_MIB": "1024"}
        provider = LocalProvider(
            LocalSettings(runtime_dir=root / "rt", runner_env={**env}, **settings)
        )
        service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=store)
        try:
            # Warm session vs direct client on the same runner.
            await service.execute(NOOP, WHO, hint="warm")
            session_id = runtime_session_id(WHO.namespace, WHO.user_id, "warm")
            handle = await service.manager.connect(session_id)  # a client of its own
            for _ in range(5):
                await service.execute(NOOP, WHO, hint="warm")
                await handle.runner.execute(NOOP, session_id=session_id)
            direct, through = [], []
            for _ in range(turns):
                direct.append(await timed(handle.runner.execute(NOOP, session_id=session_id)))
                through.append(await timed(service.execute(NOOP, WHO, hint="warm")))
            change = ExecuteRequest(language="python", code="open('n.txt','w').write('x')")
            changed = [await timed(service.execute(change, WHO, hint="warm")) for _ in range(10)]
            checkpoint_ms = []
            for _ in range(10):
                started = time.perf_counter()
                async with handle.runner.checkpoint(session_id=session_id) as chunks:
                    info = await store.put(checkpoint_key(session_id, 1), chunks, max_bytes=1 << 30)
                checkpoint_ms.append((time.perf_counter() - started) * 1000)

            # Cold session to first result (fresh sandbox, no checkpoint to restore).
            cold = [await timed(service.execute(NOOP, WHO, hint=f"cold-{i}")) for i in range(10)]

            # Restore of a 200 MiB workspace on top of a turn.
            await service.execute(BIG, WHO, hint="big")
            await handle.close()
            await service.aclose(destroy_sandboxes=True)
            fresh = ExecutionService(provider=provider, registry=InProcessRegistry(), store=store)
            restore_turn = await timed(fresh.execute(NOOP, WHO, hint="big"))
            await fresh.aclose(destroy_sandboxes=True)

            # Acquire from a warm pool.
            pooled = LocalProvider(LocalSettings(runtime_dir=root / "pool", pool_size=2))
            acquire = []
            for _ in range(5):
                await pooled.start_pool()
                started = time.perf_counter()
                handle2 = await pooled.create(service.spec)
                acquire.append((time.perf_counter() - started) * 1000)
                await handle2.close()
                await pooled.destroy(handle2.sandbox_id)

            # Cold session to first result when its sandbox comes from the warm pool
            # (the pool refilled, untimed, before each).
            from_pool = ExecutionService(provider=pooled, registry=InProcessRegistry(), store=store)
            cold_pooled = []
            for i in range(8):
                await pooled.start_pool()
                cold_pooled.append(await timed(from_pool.execute(NOOP, WHO, hint=f"pooled-{i}")))
            await from_pool.aclose(destroy_sandboxes=True)
            await pooled.close()
        finally:
            await service.aclose(destroy_sandboxes=True)
            await provider.close()

    p50d, p50t = statistics.median(direct), statistics.median(through)
    print(
        f"warm turn, no change: direct p50 {p50d:.1f} ms, ExecutionService p50 {p50t:.1f} ms"
        f" -> {p50t / p50d:.2f}x"
    )
    print(
        f"warm turn changing a file: p50 {statistics.median(changed):.1f} ms; checkpoint alone"
        f" p50 {statistics.median(checkpoint_ms):.1f} ms ({info.size} bytes),"
        f" {statistics.median(checkpoint_ms) / statistics.median(changed):.0%} of the turn"
    )
    print(
        f"cold session to first result: p50 {statistics.median(cold):.0f} ms,"
        f" p95 {pct(cold, 95):.0f} ms"
    )
    restore_ms = restore_turn - statistics.median(cold)
    print(
        f"restore of ~200 MiB on top of a cold turn: {restore_ms:.0f} ms"
        f" (the whole turn {restore_turn:.0f} ms)"
    )
    print(f"acquire from the warm pool: p50 {statistics.median(acquire):.1f} ms")
    print(
        f"cold session to first result from the warm pool: p50 {statistics.median(cold_pooled):.0f}"
        f" ms, p95 {pct(cold_pooled, 95):.0f} ms"
    )
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def speed_probe_ms() -> float:
    """CPU time of a fixed pure-Python loop on this thread: the host's speed just now."""
    started = time.thread_time()
    total = 0
    for i in range(300_000):
        total += i * i
    return (time.thread_time() - started) * 1000


def tree_cpu_ms() -> float:
    """CPU of this process and every live descendant, with the children each has reaped."""
    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = process.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total * 1000


async def cold_only(sessions: int, extra_env: dict[str, str], settings: dict[str, bool]) -> None:
    """Cold sessions to first result, each one's latency and whole-tree CPU."""
    with traversable_dir("benchcold-") as root:
        env = {"SANDCELL_RUNNER_WORKSPACE_QUOTA_MIB": "1024", **extra_env}
        if "PYTHONPATH" in os.environ:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt", runner_env=env, **settings))
        store = DirectorySnapshotStore(root / "snapshots")
        service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=store)
        try:
            # As in the full run: a session first (a zygote, where there is one, starts now).
            await service.execute(NOOP, WHO, hint="first")
            await asyncio.sleep(1.0)
            cold, cpu, probe = [], [], []
            for i in range(sessions):
                probe.append(speed_probe_ms())
                before = tree_cpu_ms()
                cold.append(await timed(service.execute(NOOP, WHO, hint=f"cold-{i}")))
                cpu.append(tree_cpu_ms() - before)
        finally:
            await service.aclose(destroy_sandboxes=True)
            await provider.close()
    print(
        f"cold session to first result: p50 {statistics.median(cold):.0f} ms,"
        f" p95 {pct(cold, 95):.0f} ms; whole-tree CPU per session p50"
        f" {statistics.median(cpu):.0f} ms (n={sessions})"
    )
    print("samples ms:", " ".join(f"{v:.0f}" for v in cold))
    print("samples cpu-ms:", " ".join(f"{v:.0f}" for v in cpu))
    slow = sum(v > 1.4 * min(probe) for v in probe)
    print(
        f"speed probe p50 {statistics.median(probe):.1f} ms (min {min(probe):.1f});"
        f" {slow} of {sessions} sessions began on a slow host (> 1.4x the min)"
    )
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--cold-only", type=int, default=0, metavar="N")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--zygote", choices=("0", "1"), help="LocalSettings.zygote (default: its own)"
    )
    args = parser.parse_args()
    chosen = {} if args.zygote is None else {"zygote": args.zygote == "1"}
    if args.cold_only:
        extra = dict(item.split("=", 1) for item in args.env)
        asyncio.run(cold_only(args.cold_only, extra, chosen))
    else:
        asyncio.run(main(args.turns, chosen))
