#!/usr/bin/env python3
"""Per-exec cost of a workspace: an ext4 image from the pool vs a tmpfs mount.

Measured in one run, in alternating rounds (these machines are noisy in phases):

(a) raw jailed ``bash -c true``: the ELF nsjail with the runner's own configuration,
    spawned and waited for (the baseline every figure is a ratio of)
(b) tmpfs: mount a quota-sized tmpfs, chown it, unmount it (what a job paid before)
(c) ext4 pool: take a reused image (a ``ws`` directory chowned to the job's UID: no
    mount) and give it back (wipe a job's few files); each image's one-time mkfs + loop
    + mount is reported apart
(d) ext4 pool, a job that leaves nothing: take and give back with nothing written
    (the commonest one-shot job), one UID and two UIDs in turn; where ``ws`` left as
    handed out is kept (``workspace/untouched.py``) this is the check instead of the
    wipe and re-make. For an A/B against another tree run this script with
    ``PYTHONPATH=DIR/packages/runner/src:DIR/packages/protocol/src`` (the editable
    install is a path in a ``.pth``, which PYTHONPATH precedes).

Figures are medians over every round's samples; the ratios are (b)/(a), (c)/(a), (c)/(b).
Run as root (mounts, loop devices). Usage:
    .venv/bin/python scripts/bench_workspace.py [--rounds 5] [--count 200]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sandcell_runner.config import MIB, RunnerSettings  # noqa: E402
from sandcell_runner.jail.nsjail_config import render_config  # noqa: E402
from sandcell_runner.jail.spec import JobLimits, JobSpec  # noqa: E402
from sandcell_runner.workspace import mounts  # noqa: E402
from sandcell_runner.workspace.images import ImagePool  # noqa: E402

QUOTA = 1024 * MIB
UID = 20_990


def _raw_nsjail(nsjail: Path, base: Path, count: int) -> list[float]:
    workspace, job_dir = base / "raw-ws", base / "raw-job"
    for directory in (workspace, job_dir):
        directory.mkdir(exist_ok=True)
    os.chown(workspace, UID, UID)
    limits = JobLimits(
        timeout_ms=10_000,
        memory_bytes=512 * MIB,
        pids=64,
        stdout_bytes=MIB,
        stderr_bytes=MIB,
        file_size_mib=64,
        open_files=256,
        tmp_mib=64,
    )
    spec = JobSpec(
        argv=["/bin/bash", "-c", "true"],
        workspace=workspace,
        job_dir=job_dir,
        uid=UID,
        gid=UID,
        env={"PATH": "/usr/bin:/bin"},
        limits=limits,
    )
    config = base / "raw.cfg"
    config.write_text(render_config(spec, cgroups_available=False))
    argv = [str(nsjail), "--quiet", "--config", str(config), "--", "/bin/bash", "-c", "true"]
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples.append(time.perf_counter() - started)
    return samples


def _tmpfs(base: Path, count: int) -> list[float]:
    target = base / "tmpfs-ws"
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        target.mkdir(mode=0o700)
        mounts.mount_tmpfs(target, size_bytes=QUOTA, uid=UID, gid=UID)
        (target / "main.py").write_bytes(b"print(1)\n")
        mounts.unmount(target)
        target.rmdir()
        samples.append(time.perf_counter() - started)
    return samples


def _ext4(pool: ImagePool, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        workspace = pool.take(uid=UID, gid=UID)
        (workspace / "main.py").write_bytes(b"print(1)\n")
        pool.give(workspace, reuse=True)
        samples.append(time.perf_counter() - started)
    return samples


def _ext4_empty(pool: ImagePool, count: int, *, uids: int) -> list[float]:
    samples = []
    for index in range(count):
        uid = UID + index % uids
        started = time.perf_counter()
        workspace = pool.take(uid=uid, gid=uid)
        pool.give(workspace, reuse=True)
        samples.append(time.perf_counter() - started)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.stderr.write("bench_workspace: run as root (mounts and loop devices)\n")
        return 2
    nsjail = RunnerSettings.from_env({"SANDCELL_RUNNER_INSECURE_NO_AUTH": "1"}).nsjail_path
    assert nsjail is not None
    base = Path(tempfile.mkdtemp(prefix="bench-ws-", dir="/var/tmp"))
    os.chmod(base, 0o711)
    pool = ImagePool(base / "images", size_bytes=QUOTA, inodes=65_536)
    try:
        started = time.perf_counter()
        pool.prepare()  # makes one image: mkfs + loop + mount
        make_s = time.perf_counter() - started
        raw: list[float] = []
        tmpfs: list[float] = []
        ext4: list[float] = []
        empty: list[float] = []
        empty2: list[float] = []
        for _ in range(args.rounds):
            raw += _raw_nsjail(nsjail, base, max(10, args.count // 10))
            tmpfs += _tmpfs(base, args.count)
            ext4 += _ext4(pool, args.count)
            empty += _ext4_empty(pool, args.count, uids=1)
            empty2 += _ext4_empty(pool, args.count, uids=2)
        r, t, e, m, m2 = (statistics.median(x) * 1e6 for x in (raw, tmpfs, ext4, empty, empty2))
        print(f"raw jailed bash -c true     p50 {r:9.1f} us  (baseline, {len(raw)} samples)")
        print(f"tmpfs mount+unmount         p50 {t:9.1f} us  = {t / r:.4f} x raw")
        print(f"ext4 image take+give        p50 {e:9.1f} us  = {e / r:.4f} x raw")
        print(f"  left empty, one UID       p50 {m:9.1f} us  = {m / r:.4f} x raw")
        print(f"  left empty, two UIDs      p50 {m2:9.1f} us  = {m2 / r:.4f} x raw")
        print(f"ext4 vs tmpfs                                = {e / t:.2f} x")
        print(f"one image (mkfs, loop, mount), once per image: {make_s * 1e3:.1f} ms")
    finally:
        pool.close()
        mounts.unmount(base / "tmpfs-ws")
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
