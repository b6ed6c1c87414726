"""``end_within``: the one kill-after-grace rule of app processes and sandbox processes."""

from __future__ import annotations

import asyncio

from sandcell_runner.jail.stopping import end_within


async def test_a_job_that_ends_in_its_grace_is_not_killed() -> None:
    done = asyncio.Event()
    killed: list[bool] = []
    asyncio.get_running_loop().call_soon(done.set)
    assert await end_within(done, grace_s=60, kill=lambda: killed.append(True)) is True
    assert killed == []


async def test_a_job_past_its_grace_is_killed_and_its_end_awaited() -> None:
    done = asyncio.Event()
    killed: list[bool] = []

    def kill() -> None:
        killed.append(True)
        asyncio.get_running_loop().call_soon(done.set)  # the kill ends it, a moment later

    assert await end_within(done, grace_s=0.01, kill=kill, killed_wait_s=60) is False
    assert killed == [True]
    assert done.is_set()


async def test_a_job_that_outlives_its_kill_is_given_up_on() -> None:
    done = asyncio.Event()
    killed: list[bool] = []
    ended = await end_within(done, grace_s=0, kill=lambda: killed.append(True), killed_wait_s=0)
    assert ended is False
    assert killed == [True]
