#!/usr/bin/env python3
"""Raw throughput of checkpoint export/restore against GNU tar, in one run, on this machine.

Generates a ~200 MiB workspace (incompressible blobs, compressible text, many
small files, nested dirs, symlinks), then times:

  export    export_checkpoint() to a counting sink, gzip and zstd
  restore   restore_checkpoint() from the exported bytes (child process included)
  tar       `tar cf` / `tar czf` / `tar --zstd -cf` to /dev/null, `tar xf` of the same

MB/s are workspace (uncompressed) megabytes per second; ratios compare against
tar in the same run, because these machines are noisy. Run as root or not: the
restore extracts as the current UID.

Usage: .venv/bin/python scripts/bench_checkpoint_raw.py [--mib 200] [--repeat 3] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio

from sandcell_protocol import PROTOCOL_VERSION, CheckpointMeta
from sandcell_runner.checkpoint.compression import Encoding
from sandcell_runner.checkpoint.export import ArchiveLimits, export_checkpoint
from sandcell_runner.checkpoint.restore import restore_checkpoint

MiB = 1 << 20
META = CheckpointMeta(session_id="bench", protocol=PROTOCOL_VERSION)
LIMITS = ArchiveLimits(max_bytes=4 << 30)
WORDS = [
    "import",
    "numpy",
    "pandas",
    "frame",
    "value",
    "index",
    "return",
    "def",
    "class",
    "self",
    "for",
    "in",
    "range",
    "print",
]


def text(rng: random.Random, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        out += (" ".join(rng.choices(WORDS, k=12)) + f" {rng.random():.6f}\n").encode()
    return bytes(out[:size])


def generate(root: Path, total_mib: int) -> int:
    """A workspace of about ``total_mib``: 40% random blobs, 40% text, 20% small files."""
    rng = random.Random(42)
    blobs, texts, smalls = (int(total_mib * MiB * share) for share in (0.4, 0.4, 0.2))
    (root / "data").mkdir(parents=True)
    for index in range(4):
        (root / "data" / f"blob{index}.npy").write_bytes(os.urandom(blobs // 4))
    for index in range(8):
        (root / "data" / f"table{index}.csv").write_bytes(text(rng, texts // 8))
    written = 0
    index = 0
    while written < smalls:
        folder = root / "src" / f"pkg{index % 40}" / f"mod{index % 7}"
        folder.mkdir(parents=True, exist_ok=True)
        size = rng.randint(200, 40_000)
        (folder / f"file{index}.py").write_bytes(text(rng, size))
        written += size
        index += 1
    (root / "empty" / "dir").mkdir(parents=True)
    os.symlink("data/table0.csv", root / "latest.csv")
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def best_of(repeat: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def export_bytes(workspace: Path, encoding: Encoding) -> bytes:
    return b"".join(export_checkpoint(workspace, META, encoding=encoding, limits=LIMITS))


def export_to_sink(workspace: Path, encoding: Encoding) -> None:
    for _ in export_checkpoint(workspace, META, encoding=encoding, limits=LIMITS):
        pass


def restore(data: bytes, scratch: Path, encoding: Encoding) -> None:
    staging = scratch / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=0o700)

    async def body() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 256 << 10):
            yield data[start : start + (256 << 10)]

    async def main() -> None:
        await restore_checkpoint(
            body(),
            staging,
            uid=os.getuid(),
            gid=os.getgid(),
            encoding=encoding,
            limits=LIMITS,
            expected_sha256=None,
        )

    anyio.run(main)


def tar(*args: str, cwd: Path, stdin: bytes | None = None) -> bytes:
    return subprocess.run(
        ["tar", *args], cwd=cwd, input=stdin, capture_output=True, check=True
    ).stdout


def tar_extract(data: bytes, scratch: Path, *flags: str) -> None:
    target = scratch / "tar-x"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    tar("-x", *flags, "-f", "-", cwd=target, stdin=data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", help="scratch directory (e.g. /dev/shm to leave the disk out)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=args.dir) as tmp:
        scratch = Path(tmp)
        workspace = scratch / "workspace"
        total = generate(workspace, args.mib)
        mb = total / 1e6
        print(f"workspace: {total / MiB:.0f} MiB in {sum(1 for _ in workspace.rglob('*'))} entries")
        # Warm the page cache so every contender reads from memory.
        tar("-c", "-f", "/dev/null", ".", cwd=workspace)

        rows: list[tuple[str, float, str]] = []
        raw_tar = best_of(args.repeat, lambda: tar("-c", "-f", "-", ".", cwd=workspace))
        rows.append(("tar cf (no compression)", raw_tar, ""))
        plain = tar("-c", "-f", "-", ".", cwd=workspace)
        raw_untar = best_of(args.repeat, lambda: tar_extract(plain, scratch))
        rows.append(("tar xf (no compression)", raw_untar, ""))

        for encoding, tar_flag in (("gzip", "-z"), ("zstd", "--zstd")):
            enc: Encoding = encoding  # type: ignore[assignment]
            ours_export = best_of(args.repeat, lambda enc=enc: export_to_sink(workspace, enc))
            theirs_export = best_of(
                args.repeat, lambda f=tar_flag: tar("-c", f, "-f", "-", ".", cwd=workspace)
            )
            data = export_bytes(workspace, enc)
            theirs_data = tar("-c", tar_flag, "-f", "-", ".", cwd=workspace)
            ours_restore = best_of(args.repeat, lambda d=data, e=enc: restore(d, scratch, e))
            theirs_restore = best_of(
                args.repeat, lambda d=theirs_data, f=tar_flag: tar_extract(d, scratch, f)
            )
            ratio = f"{total / len(data):.2f}x smaller (tar {total / len(theirs_data):.2f}x)"
            rows += [
                (f"export {encoding}", ours_export, ratio),
                (f"tar c {tar_flag}", theirs_export, ""),
                (f"restore {encoding}", ours_restore, ""),
                (f"tar x {tar_flag}", theirs_restore, ""),
            ]
            print(
                f"{encoding}: export {theirs_export / ours_export:.2f}x tar's speed, "
                f"restore {theirs_restore / ours_restore:.2f}x tar's speed"
            )

        print(f"\n{'':28} {'seconds':>8} {'MB/s':>8}")
        for name, seconds, note in rows:
            print(f"{name:28} {seconds:8.2f} {mb / seconds:8.0f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
