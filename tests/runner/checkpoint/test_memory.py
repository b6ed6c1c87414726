"""Memory stays bounded on both sides: a 256 MiB workspace does not need 256 MiB of RAM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandcell_runner.checkpoint.compression import Encoding
from tests.runner.checkpoint import GID, UID, Arena, snapshot_tree

MiB = 1 << 20

# Runs in a fresh interpreter so the peaks cover this one export and restore.
# The script's own peak is VmHWM (per address space): ru_maxrss survives exec
# and would report pytest's peak. The extractor's ru_maxrss can inherit only
# the script's small footprint at spawn time.
SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path

    import anyio
    from sandcell_protocol import PROTOCOL_VERSION, CheckpointMeta

    from sandcell_runner.checkpoint.export import ArchiveLimits, stream_checkpoint
    from sandcell_runner.checkpoint.restore import restore_checkpoint

    source, staging, encoding, uid, gid = sys.argv[1:]
    meta = CheckpointMeta(session_id="s", protocol=PROTOCOL_VERSION)
    limits = ArchiveLimits()

    async def main() -> None:
        chunks = stream_checkpoint(Path(source), meta, encoding=encoding, limits=limits)
        await restore_checkpoint(
            chunks, Path(staging), uid=int(uid), gid=int(gid), encoding=encoding,
            limits=limits, expected_sha256=None,
        )

    anyio.run(main)
    status = Path("/proc/self/status").read_text().splitlines()
    self_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    child_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(self_kib, child_kib)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_export_and_restore_of_256_mib_stay_small(
    arena: Arena, tmp_path: Path, encoding: Encoding
) -> None:
    """Peak RSS of the exporting/restoring process and of the extractor stay far below 256 MiB."""
    source = tmp_path / "source"
    source.mkdir()
    with open(source / "noise", "wb") as noise:
        for _ in range(64):
            noise.write(os.urandom(MiB))
    with open(source / "zeros", "wb") as zeros:
        zeros.truncate(192 * MiB)

    run = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(source),
            str(arena.staging),
            encoding,
            str(UID),
            str(GID),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert run.returncode == 0, run.stderr
    self_kib, child_kib = (int(value) for value in run.stdout.split())
    assert self_kib < 64 * 1024, f"exporting/feeding process peaked at {self_kib} KiB"
    assert child_kib < 64 * 1024, f"extractor peaked at {child_kib} KiB"
    restored = snapshot_tree(arena.staging)
    assert restored["noise"][4] == 64 * MiB
    assert restored["zeros"][4] == 192 * MiB
