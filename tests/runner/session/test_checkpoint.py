"""Checkpoint and restore through the runner's routes: A -> B continuity, hostile archives."""

from __future__ import annotations

import hashlib
import os
import tarfile
import threading
import time

import psutil
import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, start_runner
from tests.runner.session.helpers import SessionClient, make_archive, tree_digest

SETUP = r"""
mkdir -p dir/sub empty/nested
echo hello > dir/sub/file.txt
printf '#!/bin/sh\necho run\n' > tool.sh && chmod 755 tool.sh
ln -s dir/sub/file.txt link
chmod 0640 dir/sub/file.txt
touch -d '2020-01-02 03:04:05' dir/sub/file.txt
"""


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_checkpoint_from_a_restores_into_b(session_runner: RunnerProcess, encoding: str) -> None:
    """Same files, modes, symlinks, empty directories and mtimes; the session continues."""
    with SessionClient(session_runner) as a:
        assert a.execute(SETUP, language="bash")["status"] == "ok"
        archive = a.checkpoint(encoding)
        digest_a = tree_digest(a.workspace())
        stat_a = (a.workspace() / "dir/sub/file.txt").stat()
        magic = b"\x1f\x8b" if encoding == "gzip" else b"\x28\xb5\x2f\xfd"
        assert archive.startswith(magic)
        session_id = a.session_id
    with traversable_dir() as root:
        b_runner = start_runner(root, env={"SANDCELL_RUNNER_SESSIONS": "1"})
        try:
            with SessionClient(b_runner, session_id) as b:
                response = b.restore(archive, hashlib.sha256(archive).hexdigest())
                assert response.status_code == 200, response.text
                assert response.json()["files"] == 2
                restored = b.workspace()
                stat_b = (restored / "dir/sub/file.txt").stat()
                assert stat_b.st_mtime_ns == stat_a.st_mtime_ns
                assert (stat_b.st_mode & 0o7777) == 0o640
                assert os.readlink(restored / "link") == "dir/sub/file.txt"
                assert (restored / "empty/nested").is_dir()
                # Owners differ between runners only if their pinned UIDs do; compare by
                # content, modes and links.
                if stat_a.st_uid == stat_b.st_uid:
                    assert tree_digest(restored) == digest_a
                after = b.execute("cat link; ./tool.sh; ls empty", language="bash")
                assert after["stdout"] == "hello\nrun\nnested\n", after
                assert after["files"] == []  # restored metadata knows what was surfaced
        finally:
            b_runner.stop()


def test_sha256_mismatch_rejected(session_runner: RunnerProcess) -> None:
    with SessionClient(session_runner) as session:
        session.execute("open('a.txt', 'w').write('x')")
        archive = session.checkpoint()
        before = tree_digest(session.workspace())
        response = session.restore(archive, "0" * 64)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "archive_rejected"
        assert tree_digest(session.workspace()) == before


def test_archive_of_another_session_rejected(session_runner: RunnerProcess) -> None:
    with SessionClient(session_runner) as session:
        session.execute("open('a.txt', 'w').write('x')")
        before = tree_digest(session.workspace())
        archive = make_archive("rt_" + "0" * 64, [])
        response = session.restore(archive)
        assert response.status_code == 400
        assert "another runtime session" in response.json()["error"]["message"]
        assert tree_digest(session.workspace()) == before


def test_a_copy_of_another_session_restores_only_as_that_sessions(
    session_runner: RunnerProcess,
) -> None:
    """``X-Sandcell-Checkpoint-From`` (an E2B snapshot made into a new sandbox) lets a
    session take another's archive, only the one that header names."""
    with SessionClient(session_runner) as session:
        session.execute("open('a.txt', 'w').write('x')")
        before = tree_digest(session.workspace())
        source = "rt_" + "0" * 64
        archive = make_archive(source, [(_member("workspace/copied.txt", size=2), b"hi")])
        for named in ("rt_" + "1" * 64, "not-a-session"):
            response = session.http.post(
                "/v1/session/restore",
                content=archive,
                headers={"X-Sandcell-Checkpoint-From": named},
            )
            assert response.status_code == 400, response.text
            assert tree_digest(session.workspace()) == before
        response = session.http.post(
            "/v1/session/restore", content=archive, headers={"X-Sandcell-Checkpoint-From": source}
        )
        assert response.status_code == 200, response.text
        assert (session.workspace() / "copied.txt").read_bytes() == b"hi"


def _member(name: str, kind: bytes = tarfile.REGTYPE, **attrs: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in attrs.items():
        setattr(info, key, value)
    return info


HOSTILE = {
    "traversal": [(_member("workspace/../../escape.txt"), b"x")],
    "absolute": [(_member("/tmp/escape.txt"), b"x")],
    "outside_prefix": [(_member("elsewhere.txt"), b"x")],
    "symlink_escape": [(_member("workspace/l", tarfile.SYMTYPE, linkname="/etc"), None)],
    "symlink_dotdot": [(_member("workspace/l", tarfile.SYMTYPE, linkname="../../x"), None)],
    "write_through_symlink": [
        (_member("workspace/l", tarfile.SYMTYPE, linkname="."), None),
        (_member("workspace/l/../../x"), b"x"),
    ],
    "hardlink_out": [(_member("workspace/h", tarfile.LNKTYPE, linkname="/etc/passwd"), None)],
    "device": [(_member("workspace/dev", tarfile.CHRTYPE, devmajor=1, devminor=3), None)],
    "fifo": [(_member("workspace/fifo", tarfile.FIFOTYPE), None)],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archives_rejected_workspace_identical(
    session_runner: RunnerProcess, case: str
) -> None:
    with SessionClient(session_runner) as session:
        session.execute(
            "import os\nos.makedirs('d', exist_ok=True)\nopen('d/a.txt','w').write('1')"
        )
        before = tree_digest(session.workspace())
        response = session.restore(make_archive(session.session_id, HOSTILE[case]))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "archive_rejected"
        assert tree_digest(session.workspace()) == before
        assert not (session_runner.root / "escape.txt").exists()
        # The runner keeps serving the session.
        assert session.execute("print(open('d/a.txt').read())")["stdout"] == "1\n"


@pytest.mark.parametrize("garbage", [b"", b"\x1f\x8b\x08\x00garbage", b"not an archive at all"])
def test_corrupt_archives_rejected(session_runner: RunnerProcess, garbage: bytes) -> None:
    with SessionClient(session_runner) as session:
        session.execute("open('a.txt','w').write('1')")
        before = tree_digest(session.workspace())
        response = session.restore(garbage)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "archive_rejected"
        assert tree_digest(session.workspace()) == before


def test_truncated_checkpoint_rejected(session_runner: RunnerProcess) -> None:
    with SessionClient(session_runner) as session:
        session.execute("open('a.bin','wb').write(__import__('os').urandom(200000))")
        archive = session.checkpoint()
        before = tree_digest(session.workspace())
        response = session.restore(archive[: len(archive) // 2])
        assert response.status_code == 400
        assert tree_digest(session.workspace()) == before


def test_checkpoint_memory_is_bounded(session_runner: RunnerProcess) -> None:
    """A 256 MiB workspace checkpoints with the runner's RSS growing less than 64 MiB."""
    with SessionClient(session_runner) as session:
        made = session.execute(
            "import os\n"
            "for i in range(8):\n"
            "    with open(f'big{i}.bin', 'wb') as f: f.write(os.urandom(32 * 1024 * 1024))\n",
            limits={"memory_mib": 1024},
            timeout_ms=120_000,
        )
        assert made["status"] == "ok", made
        process = psutil.Process(session_runner.process.pid)
        baseline = process.memory_info().rss
        peak = baseline
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, process.memory_info().rss)
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            size = 0
            with session.http.stream(
                "GET", "/v1/session/checkpoint", headers={"Accept-Encoding": "zstd"}
            ) as response:
                assert response.status_code == 200
                for chunk in response.iter_raw():
                    size += len(chunk)
        finally:
            done.set()
            sampler.join()
        assert size > 200 * 1024 * 1024
        assert peak - baseline < 64 * 1024 * 1024, (baseline, peak)


def test_checkpoint_include_exclude(session_runner: RunnerProcess) -> None:
    """A PersistentWorkspace's globs decide what the checkpoint keeps."""
    import io

    import zstandard

    with SessionClient(session_runner) as session:
        session.execute(
            "mkdir -p src/pkg cache/deep node_modules/x && touch src/pkg/a.py src/b.txt "
            "cache/deep/blob node_modules/x/i.js top.py",
            language="bash",
        )
        response = session.http.get(
            "/v1/session/checkpoint",
            params=[("include", "**/*.py"), ("include", "src/**"), ("exclude", "cache")],
            headers={"Accept-Encoding": "zstd"},
        )
        assert response.status_code == 200
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(response.content)).read()
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            names = {m.name for m in tar.getmembers() if not m.isdir()}
        assert names == {
            ".sandcell-checkpoint.json",
            "workspace/src/pkg/a.py",
            "workspace/src/b.txt",
            "workspace/top.py",
        }
        bad = session.http.get("/v1/session/checkpoint", params={"include": "../etc"})
        assert bad.status_code == 400
