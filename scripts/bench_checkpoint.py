#!/usr/bin/env python3
"""Benchmark checkpoint and restore through the runner's HTTP routes against tar.

One generated tree of >= 200 MiB (about a thousand small source files, large
compressible CSV, incompressible random data) in a session workspace. In one run:
checkpoint (gzip and zstd) and restore throughput in MB/s of workspace, against
`tar cf` of the same tree and `tar -x` of the same archive (decompressing it too)
into the same kind of filesystem as the runner's workspace (an image of the
runner's own pool, or a tmpfs), plus the runner's peak RSS growth and CPU-ms.

The transfers are driven by curl, a client that is not itself the bottleneck on
a 2-core machine (an httpx client in this process takes CPU the runner needs);
``--client httpx`` measures with httpx instead, as the orchestrator would send.

``--small`` measures instead the latency of restoring a small (1.3 KB) checkpoint
through the HTTP route, alternating with its floors in the same run: an
interpreter start (``python -I -c pass``) and the extractor's start-up (the
interpreter plus the extractor's imports).

``--baseline DIR`` (with ``--small``) adds a third runner that runs the code of DIR
(a checkout of another commit, e.g. ``git archive main packages | tar -x -C DIR``),
runner and extractor alike, for an A/B of a change in the same run.

Usage: .venv/bin/python scripts/bench_checkpoint.py [--client curl|httpx]
       [--small [--count N] [--baseline DIR]]
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.paths import traversable_dir  # noqa: E402
from tests.fixtures.runner_process import RunnerProcess, start_runner, tree_python  # noqa: E402

from sandcell_protocol import headers as protocol_headers  # noqa: E402
from sandcell_protocol import runtime_session_id  # noqa: E402
from sandcell_runner.workspace.images import ImagePool  # noqa: E402

SMALL = "--small" in sys.argv[1:]
SMALL_COUNT = int(sys.argv[sys.argv.index("--count") + 1]) if "--count" in sys.argv else 60
BASELINE = Path(sys.argv[sys.argv.index("--baseline") + 1]) if "--baseline" in sys.argv else None
CLIENT = "httpx" if "httpx" in sys.argv[1:] or "--client=httpx" in sys.argv else "curl"

GENERATE = r"""
import os, random
random.seed(7)
os.makedirs('src', exist_ok=True)
for i in range(1000):
    d = f'src/pkg{i % 40}'
    os.makedirs(d, exist_ok=True)
    with open(f'{d}/module_{i}.py', 'w') as f:
        f.write(''.join(f'def func_{i}_{j}(x):\n    return x * {j} + {i}\n\n' for j in range(40)))
os.makedirs('data', exist_ok=True)
for n in range(4):
    with open(f'data/table{n}.csv', 'w') as f:
        f.write('id,name,value,flag\n')
        line = 0
        while f.tell() < 30 * 1024 * 1024:
            f.write(f'{line},name-{line % 977},{(line * 7919) % 100000},{line % 2}\n' * 100)
            line += 100
with open('data/random.bin', 'wb') as f:
    for _ in range(80):
        f.write(os.urandom(1024 * 1024))
"""

MB = 1_000_000


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(fn: object) -> float:
    started = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - started


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.baseline = self.process.memory_info().rss
        self.peak = self.baseline
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def checkpoint(runner: RunnerProcess, session: str, encoding: str, out: Path) -> tuple[float, int]:
    headers = {**runner.headers(), "X-Runtime-Session-Id": session, "Accept-Encoding": encoding}
    started = time.perf_counter()
    if CLIENT == "curl":
        subprocess.run(
            [
                *("curl", "-sSf", "-o", str(out)),
                *_curl_headers(headers),
                runner.url + "/v1/session/checkpoint",
            ],
            check=True,
        )
        return time.perf_counter() - started, out.stat().st_size
    size = 0
    with (
        httpx.stream(
            "GET", runner.url + "/v1/session/checkpoint", headers=headers, timeout=600
        ) as response,
        out.open("wb") as sink,
    ):
        response.raise_for_status()
        for chunk in response.iter_raw():
            sink.write(chunk)
            size += len(chunk)
    return time.perf_counter() - started, size


def restore(runner: RunnerProcess, session: str, archive: Path) -> float:
    # The digest travels as the orchestrator sends it, so the runner's check is measured too.
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    headers = {
        **runner.headers(),
        "X-Runtime-Session-Id": session,
        protocol_headers.CHECKPOINT_SHA256: digest,
    }
    started = time.perf_counter()
    if CLIENT == "curl":
        # -T streams the file (--data-binary would read it all first); no 100-continue wait.
        subprocess.run(
            [
                *("curl", "-sSf", "-o", "/dev/null", "-X", "POST", "-T", str(archive)),
                *("-H", "Expect:", *_curl_headers(headers)),
                runner.url + "/v1/session/restore",
            ],
            check=True,
        )
        return time.perf_counter() - started

    def body() -> object:
        with archive.open("rb") as source:
            while chunk := source.read(1 << 20):
                yield chunk

    response = httpx.post(
        runner.url + "/v1/session/restore", content=body(), headers=headers, timeout=600
    )
    response.raise_for_status()
    return time.perf_counter() - started


def _cpu_ms(pid: int) -> tuple[float, float]:
    """CPU time of a runner itself and of everything under it so far (the extractor
    children its fork server reaped, the server itself, reaped helpers), in ms."""
    times = psutil.Process(pid).cpu_times()
    own = (times.user + times.system) * 1000
    return own, tree_cpu_ms(pid) - own


def _children_cpu_ms() -> float:
    """CPU time of this process's reaped children so far (tar and its decompressor), in ms."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1000


@contextlib.contextmanager
def same_kind_of_filesystem(runner: RunnerProcess, at: Path) -> Iterator[Path]:
    """An empty directory on a filesystem like the runner's session workspace: an image
    of the runner's own pool (loop-mounted ext4, made by the same code) or a tmpfs."""
    workspace = next((runner.workspace_root / "session").glob("ws-*"))
    fstype = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", str(workspace)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if fstype == "ext4":
        pool = ImagePool(at, size_bytes=2048 << 20, inodes=(2048 << 20) >> 14)
        pool.prepare()
        try:
            yield pool.take(uid=0, gid=0)
        finally:
            pool.close()
        return
    at.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", str(at)], check=True)
    try:
        yield at
    finally:
        subprocess.run(["umount", str(at)], check=True)


def _curl_headers(headers: dict[str, str]) -> list[str]:
    # Passed on the command line: fine for a benchmark's throwaway runner token.
    return [arg for name, value in headers.items() for arg in ("-H", f"{name}: {value}")]


def small_restore() -> int:
    """p50 / p90 of a 1.3 KB checkpoint's restore through HTTP against its floors.

    Two runners restore alternately, A as configured by default and B on
    asyncio's own event loop, so the loop's effect on the extractor's spawn is
    measured in the same run.
    """
    session = runtime_session_id("bench", "user", "small")
    floors = {
        "python -I -c pass": [sys.executable, "-I", "-c", "pass"],
        "extractor start-up": [
            *(sys.executable, "-I", "-X", "utf8", "-c"),
            "import sandcell_runner.checkpoint.extractor_child",
        ],
    }
    envs = {
        "restore via HTTP, A": {},
        "restore via HTTP, B asyncio": {"SANDCELL_RUNNER_EVENT_LOOP": "asyncio"},
    }
    pythons: dict[str, str] = {}
    if BASELINE is not None:
        envs["restore via HTTP, C baseline"] = {}
    samples: dict[str, list[float]] = {name: [] for name in (*floors, *envs)}
    with traversable_dir("benchcp-") as base, contextlib.ExitStack() as stack:
        if BASELINE is not None:
            pythons["restore via HTTP, C baseline"] = tree_python(BASELINE, base / "venv")
        clients = {}
        pids: dict[str, int] = {}
        for index, (name, extra) in enumerate(envs.items()):
            runner = start_runner(
                base / f"r{index}",
                env={"SANDCELL_RUNNER_SESSIONS": "1", **extra},
                python=pythons.get(name, sys.executable),
            )
            stack.callback(runner.stop)
            pids[name] = runner.process.pid
            headers = {**runner.headers(), "X-Runtime-Session-Id": session}
            clients[name] = stack.enter_context(
                httpx.Client(base_url=runner.url, headers=headers, timeout=60)
            )
        first = next(iter(clients.values()))
        code = "import os; open('notes.txt', 'w').write(os.urandom(650).hex())"
        made = first.post("/v1/execute", json={"language": "python", "code": code})
        assert made.json()["status"] == "ok", made.text
        archive = first.get("/v1/session/checkpoint").content
        restore_headers = {protocol_headers.CHECKPOINT_SHA256: hashlib.sha256(archive).hexdigest()}
        cpu_from: dict[str, float] = {}
        for round_ in range(SMALL_COUNT + 5):
            if round_ == 5:
                cpu_from = {name: tree_cpu_ms(pid) for name, pid in pids.items()}
            for name, argv in floors.items():
                seconds = timed(lambda argv=argv: subprocess.run(argv, check=True))
                if round_ >= 5:
                    samples[name].append(seconds * 1000)
            for name, client in clients.items():
                started = time.perf_counter()
                client.post(
                    "/v1/session/restore", content=archive, headers=restore_headers
                ).raise_for_status()
                if round_ >= 5:
                    samples[name].append((time.perf_counter() - started) * 1000)
        time.sleep(1)  # what the last restore set going (a spare's start) is counted too
        cpu = {
            name: (tree_cpu_ms(pid) - cpu_from[name]) / SMALL_COUNT for name, pid in pids.items()
        }
    print(f"{len(archive)} B checkpoint, {SMALL_COUNT} alternating rounds (after 5 warm-up),")
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, values in samples.items():
        ordered = sorted(values)
        p50, p90 = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.9)]
        per = f"  tree CPU {cpu[name]:6.1f} ms/restore" if name in cpu else ""
        print(f"  {name:<28} p50 {p50:7.1f} ms  p90 {p90:7.1f} ms{per}")
    return 0


def tree_cpu_ms(pid: int) -> float:
    """CPU-ms of a runner and everything under it: itself, its reaped children, and
    each live descendant with the children it reaped (a fork server's extractors)."""
    total = 0.0
    root = psutil.Process(pid)
    for process in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += (
                times.user + times.system + times.children_user + times.children_system
            ) * 1000
    return total


def main() -> int:
    if SMALL:
        return small_restore()
    session = runtime_session_id("bench", "user", "checkpoint")
    env = {"SANDCELL_RUNNER_SESSIONS": "1", "SANDCELL_RUNNER_WORKSPACE_QUOTA_MIB": "2048"}
    with traversable_dir("benchcp-") as base, tempfile.TemporaryDirectory() as scratch:
        source = start_runner(base / "a", env=env)
        target = start_runner(base / "b", env=env)
        try:
            made = httpx.post(
                source.url + "/v1/execute",
                json={
                    "language": "python",
                    "code": GENERATE,
                    "timeout_ms": 600_000,
                    "limits": {"memory_mib": 2048, "stdout_bytes": 1000},
                },
                headers={**source.headers(), "X-Runtime-Session-Id": session},
                timeout=900,
            ).json()
            assert made["status"] == "ok", made
            workspace = next((source.workspace_root / "session").glob("ws-*"))
            size = tree_bytes(workspace)
            tar_path = Path(scratch) / "tree.tar"
            tar_c = timed(
                lambda: subprocess.run(
                    ["tar", "cf", str(tar_path), "-C", str(workspace), "."], check=True
                )
            )
            extract_dir = base / "extract"
            extract_dir.mkdir()
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", str(extract_dir)], check=True
            )
            try:
                tar_x = timed(
                    lambda: subprocess.run(
                        ["tar", "xf", str(tar_path), "-C", str(extract_dir)], check=True
                    )
                )
            finally:
                subprocess.run(["umount", str(extract_dir)], check=True)
            results = {}
            for encoding in ("zstd", "gzip"):
                archive = Path(scratch) / f"cp.{encoding}"
                with RssSampler(source.process.pid) as rss:
                    seconds, compressed = checkpoint(source, session, encoding, archive)
                same_fs = same_kind_of_filesystem(source, base / f"same-{encoding}")
                with same_fs as into:
                    # The baseline: GNU tar extracting the same archive (decompressing it
                    # too) into the same kind of filesystem as the runner's workspace.
                    flag = "--zstd" if encoding == "zstd" else "-z"
                    tar_cpu = _children_cpu_ms()
                    tar_same = timed(
                        lambda into=into, a=archive, f=flag: subprocess.run(
                            ["tar", "-x", f, "-f", str(a), "-C", str(into)], check=True
                        )
                    )
                    tar_cpu = _children_cpu_ms() - tar_cpu
                before = _cpu_ms(target.process.pid)
                restore_s = restore(target, session, archive)
                after = _cpu_ms(target.process.pid)
                cpu = (after[0] - before[0], after[1] - before[1], tar_cpu)
                results[encoding] = (
                    seconds,
                    compressed,
                    restore_s,
                    rss.peak - rss.baseline,
                    tar_same,
                    cpu,
                )
        finally:
            source.stop()
            target.stop()
    print(f"tree: {size / MB:.0f} MB ({size / 2**20:.0f} MiB), client {CLIENT}")
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"tar cf  {size / MB / tar_c:8.1f} MB/s")
    print(f"tar xf  {size / MB / tar_x:8.1f} MB/s (the plain tar, into tmpfs)")
    for encoding, (seconds, compressed, restore_s, growth, tar_same, cpu) in results.items():
        rate = size / MB / seconds
        print(
            f"{encoding:5} checkpoint {rate:7.1f} MB/s ({tar_c / seconds:.2f}x tar cf)"
            f"  archive {compressed / MB:.0f} MB  runner RSS growth {growth / 2**20:.0f} MiB"
        )
        print(
            f"      restore {size / MB / restore_s:7.1f} MB/s ({tar_same / restore_s:.2f}x tar -x"
            f" of the same archive into the same kind of filesystem, {size / MB / tar_same:.1f}"
            f" MB/s; {tar_x / restore_s:.2f}x the plain tar into tmpfs); CPU-ms: runner"
            f" {cpu[0]:.0f} + extractor {cpu[1]:.0f}, tar {cpu[2]:.0f}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
