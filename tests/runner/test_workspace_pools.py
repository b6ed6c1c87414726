"""A one-shot job's directories from the pools, on the event loop: only when nothing must be made.

``WorkspaceManager.create_job_now`` serves a job from a reused ``jobs/<id>`` and a
ready image (a ``mkdir`` and a ``chown``); anything that would wait on the
kernel (a new directory, ``mkfs`` of an image) is left to ``create_job`` in a
thread. Real ext4 images on loop devices, as the runner uses them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.workspace.manager import WorkspaceManager
from tests.fixtures.paths import traversable_dir

UID = 20_997


@pytest.fixture
def manager() -> Iterator[WorkspaceManager]:
    if os.geteuid() != 0:
        pytest.fail("workspace images need root (loop devices and mounts)")
    with traversable_dir("pools-") as base:
        workspaces = WorkspaceManager(
            base / "root", quota_bytes=16 << 20, inodes=1024, image_dir=base / "images"
        )
        workspaces.prepare()
        assert workspaces.backend == "ext4", workspaces.images_refused
        try:
            yield workspaces
        finally:
            workspaces.close()


def _ready_images(manager: WorkspaceManager) -> list[object]:
    images = manager.images
    assert images is not None
    with images._lock:
        return list(images._ready)


def test_nothing_is_made_on_the_loop_and_a_reused_directory_serves_the_next_job(
    manager: WorkspaceManager,
) -> None:
    # The first job finds no emptied jobs/<id>: making one is the thread's work.
    assert manager.create_job_now(uid=UID, gid=UID) is None
    first = manager.create_job(uid=UID, gid=UID)
    (first.workspace / "left-over").write_bytes(b"of the first job")
    (first.job_dir / "main.sh").write_bytes(b"true")
    manager.remove_job(first)
    assert manager.images is not None
    # Taking the one ready image started a refill: let it finish making its image
    # first, or its mkfs (late under load) would be counted as this job's.
    refill = manager.images._refill
    if refill is not None:
        refill.join()
    made = manager.images._made

    second = manager.create_job_now(uid=UID + 1, gid=UID + 1)

    assert second is not None
    assert second.job_dir == first.job_dir  # the emptied jobs/<id>, reused
    # Only the entry file is kept, for the next job to write over (test_entry_reuse.py).
    assert os.listdir(second.job_dir) == ["main.sh"]
    assert os.listdir(second.workspace) == []  # nothing of the first job
    st = os.stat(second.workspace)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID + 1, UID + 1, 0o700)
    assert manager.images._made == made  # a ready image: no mkfs on the loop
    manager.remove_job(second)


def test_without_a_ready_image_the_directory_is_kept_for_the_thread(
    manager: WorkspaceManager,
) -> None:
    first = manager.create_job(uid=UID, gid=UID)
    manager.remove_job(first)
    images = manager.images
    assert images is not None
    # Every ready image taken (a session's workspace, a restore's staging).
    held = [images.take(uid=UID, gid=UID) for _ in _ready_images(manager)]
    assert _ready_images(manager) == []
    images._refill_soon = lambda: None  # type: ignore[method-assign]  # keep it empty

    assert manager.create_job_now(uid=UID + 1, gid=UID + 1) is None

    # The emptied jobs/<id> went back to the pool: the thread's create_job reuses it.
    later = manager.create_job(uid=UID + 1, gid=UID + 1)
    assert later.job_dir == first.job_dir
    assert Path(later.workspace).is_dir()
    manager.remove_job(later)
    for workspace in held:
        images.give(workspace, reuse=True)


def _image_file(manager: WorkspaceManager, workspace: Path) -> Path:
    assert manager.images is not None
    return manager.images.directory / workspace.parent.name.replace(".mnt", ".img")


def test_a_small_workspace_is_wiped_on_the_loop_and_served_again(
    manager: WorkspaceManager,
) -> None:
    first = manager.create_job(uid=UID, gid=UID)
    for index in range(5):
        (first.workspace / f"out-{index}.txt").write_bytes(b"x" * 100)
    (first.workspace / "sub").mkdir()
    (first.workspace / "sub" / "deep.txt").write_bytes(b"y")

    assert manager.remove_job_now(first) is True

    assert not first.workspace.exists()  # the image's ws went with the job's files
    again = manager.create_job_now(uid=UID + 1, gid=UID + 1)
    assert again is not None
    assert os.listdir(again.workspace) == []
    assert manager.remove_job_now(again) is True


@pytest.mark.parametrize("what", ["many files", "big file"])
def test_a_bigger_workspace_is_left_to_the_thread_untouched(
    manager: WorkspaceManager, what: str
) -> None:
    job = manager.create_job(uid=UID, gid=UID)
    if what == "many files":
        for index in range(100):
            (job.workspace / f"f{index}").write_bytes(b"")
    else:
        (job.workspace / "big").write_bytes(os.urandom(1 << 20))
    os.sync()  # blocks are counted once allocated

    assert manager.remove_job_now(job) is False

    assert len(os.listdir(job.workspace)) == (100 if what == "many files" else 1)
    manager.remove_job(job)  # the thread's path wipes it
    assert not job.workspace.exists()


def test_an_image_given_back_after_holding_megabytes_returns_them_to_the_host(
    manager: WorkspaceManager,
) -> None:
    """No online discard (a wipe never waits on the loop device): a big image is
    trimmed when given back instead, so its sparse backing file shrinks again."""
    job = manager.create_job(uid=UID, gid=UID)
    image_file = _image_file(manager, job.workspace)
    before = os.stat(image_file).st_blocks
    (job.workspace / "big").write_bytes(os.urandom(8 << 20))
    os.sync()
    grown = os.stat(image_file).st_blocks
    assert grown - before >= (8 << 20) // 512  # 512-byte units

    manager.remove_job(job)

    assert os.stat(image_file).st_blocks - before < (1 << 20) // 512
