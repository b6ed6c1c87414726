"""A one-shot job's workspace is kept for the next job only when it was left exactly as
handed out; every kind of leftover leads to the wipe.

Real jobs in real nsjail on a runner with ext4 images (``workspace/images.py``,
``workspace/untouched.py``). Each job probes its workspace's root: its entries, mode,
owner, xattrs and inode flags, and which inode of which filesystem it is: the
filesystem's ``st_dev`` (one per image) and the inode's generation
(``FS_IOC_GETVERSION``: ext4 draws a new random one for each inode it allocates), so a
directory made anew after a wipe is told from a kept one even when the inode number
is reused. A pair of jobs runs on one image: the runner's pool hands out the image
given back last, and the test waits for the first job's removal before the second.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, start_runner
from tests.runner.helpers import execute

PROBE = """
import fcntl, json, os, stat
fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
st = os.fstat(fd)
generation = fcntl.ioctl(fd, 0x80087601, bytes(8))  # FS_IOC_GETVERSION
flags = fcntl.ioctl(fd, 0x80086601, bytes(8))  # FS_IOC_GETFLAGS
print(json.dumps({
    "entries": sorted(os.listdir(".")),
    "mode": stat.S_IMODE(st.st_mode),
    "owner": [st.st_uid, st.st_gid],
    "me": [os.getuid(), os.getgid()],
    "xattrs": sorted(os.listxattr(".")),
    "flags": int.from_bytes(flags[:4], "little"),
    "inode": [st.st_dev, int.from_bytes(generation[:4], "little")],
}))
"""

LEFTOVERS = {
    "a file": "open('out.txt', 'w').write('left')",
    "a hidden file": "open('.hidden', 'w').write('left')",
    "an empty subdirectory": "os.mkdir('sub')",
    "a hard link": "open('a', 'w').write('x'); os.link('a', 'b'); os.unlink('a')",
    "a fifo": "os.mkfifo('fifo')",
    "a socket": "import socket; socket.socket(socket.AF_UNIX).bind('sock')",
    "a symlink": "os.symlink('/etc/passwd', 'link')",
    "a chmod of the root": "os.chmod('.', 0o755)",
    # The job's user namespace maps only its own UID and GID: a chown to them is all
    # it can do, and it moves only the ctime.
    "a chown of the root": "os.chown('.', os.getuid(), os.getgid())",
    "an xattr on the root": "os.setxattr('.', 'user.left', b'by the job')",
    "a chattr flag on the root": (
        "fd = os.open('.', os.O_RDONLY | os.O_DIRECTORY)\n"
        "flags = int.from_bytes(fcntl.ioctl(fd, 0x80086601, bytes(8))[:4], 'little')\n"
        "fcntl.ioctl(fd, 0x40086602, (flags | 0x40).to_bytes(4, 'little'))  # +d (nodump)"
    ),
    "a file made and removed": "open('t', 'w').close(); os.unlink('t')",
    "a file made and removed, times set back": (
        "st = os.stat('.'); open('t', 'w').close(); os.unlink('t')\n"
        "os.utime('.', ns=(st.st_atime_ns, st.st_mtime_ns))"
    ),
}
CTIME_ONLY = {
    "a chown of the root",
    "a file made and removed",
    "a file made and removed, times set back",
}
"""Leftovers that change nothing a job sees of the root but its ctime (and mtime)."""


def _probe(runner: RunnerProcess, leave: str = "") -> dict[str, Any]:
    code = f"import fcntl, os\n{leave}\n{PROBE}" if leave else PROBE
    result = execute(runner, language="python", code=code)
    assert result["status"] == "ok", result
    seen: dict[str, Any] = json.loads(result["stdout"])
    _settle(runner)
    return seen


def _settle(runner: RunnerProcess) -> None:
    """Wait for the last job's removal (its image given back, then its job directory
    recycled: emptied but for its entry file, kept with mode 0), so the next job takes
    that image."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        jobs = (runner.workspace_root / "jobs").glob("*/job/*")
        if all(stat.S_IMODE(kept.lstat().st_mode) == 0 for kept in jobs):
            return
        time.sleep(0.01)
    pytest.fail("the last job's directories were not removed in 10 s")


def _images(root: Path) -> list[Path]:
    """The runner's mounted workspace images."""
    return [mnt for mnt in (root / "workspace-images").glob("*.mnt") if os.path.ismount(mnt)]


@contextlib.contextmanager
def _settled_runner(env: dict[str, str] | None = None) -> Iterator[RunnerProcess]:
    """A runner whose image pool has settled: images are made ahead while the pool
    runs empty, and a pair of jobs compared must run on one."""
    with traversable_dir() as root:
        process = start_runner(root, env=env)
        try:
            assert _images(root), "the runner has no workspace images (ext4 backend)"
            _probe(process)  # takes the one image made at start: a second is made ahead
            deadline = time.monotonic() + 30
            while (
                len(_images(root)) < 2 or _probe(process)["inode"][0] != _probe(process)["inode"][0]
            ):
                assert time.monotonic() < deadline, "the pool did not settle in 30 s"
                time.sleep(0.05)
            yield process
        finally:
            process.stop()


@pytest.fixture(scope="module")
def runner() -> Iterator[RunnerProcess]:
    """A runner of this module's own, its pool settled."""
    with _settled_runner() as process:
        yield process


def test_jobs_on_the_hosts_network_never_get_a_kept_workspace() -> None:
    """With SANDCELL_RUNNER_ALLOW_NETWORK=1 jobs share the host's abstract unix sockets
    and could pass a descriptor of their workspace on: none is kept, however untouched."""
    with _settled_runner({"SANDCELL_RUNNER_ALLOW_NETWORK": "1"}) as shared:
        first = _probe(shared)
        second = _probe(shared)
    assert first["inode"][0] == second["inode"][0]  # one image: the pair is comparable
    assert first["inode"][1] != second["inode"][1]  # but its ws was made anew
    assert second["entries"] == [], second
    assert second["owner"] == second["me"], second


@pytest.fixture(scope="module")
def clean(runner: RunnerProcess) -> dict[str, Any]:
    """What a job sees of a workspace nobody touched."""
    return _probe(runner)


def _assert_as_handed_out(seen: dict[str, Any], clean: dict[str, Any]) -> None:
    assert seen["entries"] == [], seen
    assert seen["mode"] == 0o700, seen
    assert seen["owner"] == seen["me"], seen
    assert seen["xattrs"] == [], seen
    assert seen["flags"] == clean["flags"], seen


def test_a_workspace_left_as_handed_out_is_kept(runner: RunnerProcess) -> None:
    """Jobs that leave nothing (one only looks) hand the next job the same directory."""
    first = _probe(runner)
    looked = _probe(runner, "os.listdir('.'); os.stat('.'); os.access('.', os.W_OK)")
    after = _probe(runner)
    assert first["inode"] == looked["inode"] == after["inode"]
    _assert_as_handed_out(after, first)


@pytest.mark.parametrize("leave", sorted(LEFTOVERS))
def test_a_leftover_leads_to_the_wipe(
    runner: RunnerProcess, clean: dict[str, Any], leave: str
) -> None:
    """The next job gets a directory made anew (another inode generation), empty, with
    the mode, owner, xattrs and flags of a clean one."""
    left = _probe(runner, LEFTOVERS[leave])
    after = _probe(runner)
    if leave not in CTIME_ONLY:  # the leftover is there to see (or it tests nothing)
        assert left["entries"] or left["mode"] != 0o700 or left["xattrs"] or left["flags"] & 0x40
    assert after["inode"][0] == left["inode"][0], "not the same image: the test proves nothing"
    assert after["inode"] != left["inode"], f"{leave}: the workspace was kept"
    _assert_as_handed_out(after, clean)
