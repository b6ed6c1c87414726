"""A released job UID keeps its host-wide lease while it waits in the pool, and two
runners on one host still never hold the same UID at once.

Pools over one lease directory stand for runners on one host (an ``flock`` belongs to
an open file description, so two pools in one process exclude each other as two
processes do); then two real runners over the host's own lease directory.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.errors import BusyError
from sandcell_runner.jail.uidpool import LEASE_DIR, UidPool
from tests.fixtures.runner_process import RunnerProcess
from tests.runner.conftest import StartRunner
from tests.runner.helpers import execute

LOW, HIGH = 23_100, 23_103
"""A UID range no other test's runner uses."""


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("job UIDs are leased only by a root runner (else every job is its user)")


@pytest.fixture
def lease_dir(tmp_path: Path) -> Path:
    return tmp_path / "uid-leases"


@pytest.fixture
def pools(lease_dir: Path) -> Iterator[tuple[UidPool, UidPool]]:
    need_root()
    first = UidPool(LOW, HIGH, lease_dir=lease_dir)
    second = UidPool(LOW, HIGH, lease_dir=lease_dir)
    try:
        yield first, second
    finally:
        first.close()
        second.close()


def test_a_released_uid_stays_leased_and_is_taken_again(pools: tuple[UidPool, UidPool]) -> None:
    """A's released UID is A's next one; B, meanwhile, gets another, and A and B then
    hold different UIDs at once."""
    a, b = pools
    uid = a.allocate()
    a.release(uid)
    other = b.allocate()
    assert other != uid  # still A's: its lease was kept
    assert a.allocate() == uid
    assert a.in_use.isdisjoint(b.in_use)


def test_every_uid_goes_to_one_pool_only(pools: tuple[UidPool, UidPool]) -> None:
    """Taken and released in turns by both, the range run out each time: never one UID
    in both pools at once, and the other pool's free UIDs are not to be had."""
    a, b = pools
    for _ in range(3):
        held_a = {a.allocate(), a.allocate()}
        held_b = {b.allocate(), b.allocate()}
        assert held_a.isdisjoint(held_b)
        with pytest.raises(BusyError):
            b.allocate()
        for uid in held_a:
            a.release(uid)
        for uid in held_b:
            b.release(uid)
        assert {b.allocate(), b.allocate()} == held_b  # its own, kept
        with pytest.raises(BusyError):
            b.allocate()  # A's free UIDs are still A's
        for uid in held_b:
            b.release(uid)


def test_close_drops_the_leases_of_free_uids(pools: tuple[UidPool, UidPool]) -> None:
    """At the runner's stop its free UIDs leave the pool, and their leases with them."""
    a, b = pools
    uids = [a.allocate() for _ in range(4)]
    for uid in uids:
        a.release(uid)
    a.close()
    assert sorted(b.allocate() for _ in range(4)) == uids
    assert a.in_use == frozenset()


def test_uids_released_past_keep_leased_drop_their_lease(lease_dir: Path) -> None:
    need_root()
    a = UidPool(LOW, HIGH, lease_dir=lease_dir, keep_leased=1)
    b = UidPool(LOW, HIGH, lease_dir=lease_dir)
    try:
        first, second = a.allocate(), a.allocate()
        a.release(first)  # kept
        a.release(second)  # one too many: its lease goes
        assert b.allocate() == second
        assert a.allocate() == first
    finally:
        a.close()
        b.close()


JOB_UID = "import os, sys, time\ntime.sleep(float(sys.argv[1]))\nprint(os.getuid())"


def _job_uid(runner: RunnerProcess, wait_s: float) -> int:
    result = execute(runner, language="python", code=JOB_UID, args=[str(wait_s)])
    assert result["status"] == "ok", result
    return int(result["stdout"])


def test_two_runners_on_one_host_never_share_a_uid(runner_factory: StartRunner) -> None:
    """Runner A's job ends and its UID waits in A's pool; jobs of A and B then run at
    once, on different UIDs. When A stops, its UID's lease is dropped."""
    need_root()
    env = {"SANDCELL_RUNNER_UID_MIN": str(LOW), "SANDCELL_RUNNER_UID_MAX": str(HIGH)}
    a, b = runner_factory(**env), runner_factory(**env)
    a_uid = _job_uid(a, 0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # B first: were A's free UID not leased any more, B would take it (the lowest).
        on_b = pool.submit(_job_uid, b, 1.5)
        on_a = pool.submit(_job_uid, a, 0.5)
        assert on_a.result() != on_b.result()
    assert on_a.result() == a_uid  # the same UID again: no re-lease
    probe = UidPool(a_uid, a_uid, lease_dir=LEASE_DIR)
    try:
        with pytest.raises(BusyError):
            probe.allocate()  # A still holds it
        a.stop()
        assert probe.allocate() == a_uid
    finally:
        probe.close()
