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
    made = manager.images._made

    second = manager.create_job_now(uid=UID + 1, gid=UID + 1)

    assert second is not None
    assert second.job_dir == first.job_dir  # the emptied jobs/<id>, reused
    assert os.listdir(second.job_dir) == []
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
