"""A ``WatchDir`` stream (the async SDK's ``files.watch_dir``) whose poll finds the
session busy, through the real ``e2b`` SDK: another call holds the session past the
runner's ``SANDCELL_RUNNER_SESSION_WAIT_MS`` (here a remove of a large tree, with the
wait cut to 100 ms), the poll is skipped and the stream stays open; the next poll
reports what changed. Before, that poll ended the stream with "another call holds
this session" (``INVALID_ARGUMENT``), and nothing after it was reported."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from e2b import AsyncSandbox, FilesystemEvent

from tests.e2b_api.conftest import E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers

FILES = 50_000


@pytest.fixture(scope="module")
def served() -> Iterator[E2bServe]:
    with traversable_dir("e2b-watchbusy-") as base:
        service = start_serve(base, env={"SANDCELL_RUNNER_SESSION_WAIT_MS": "100"})
        try:
            yield service
        finally:
            stop_serve(service)
            assert not stop_leftovers(service.runtime_dir)


async def test_a_busy_poll_is_skipped_and_the_stream_stays_open(served: E2bServe) -> None:
    sandbox = await AsyncSandbox.create(**served.opts())
    try:
        await sandbox.files.make_dir("w")
        await sandbox.commands.run(
            "python3 -c \"import os; os.mkdir('big')\n"
            f"for i in range({FILES}): open(f'big/{{i}}', 'w').close()\"",
            timeout=120,
        )
        seen: list[FilesystemEvent] = []
        handle = await sandbox.files.watch_dir("w", on_event=seen.append)
        try:
            # Holds the session lock while it removes the tree: the polls meanwhile
            # wait 100 ms for it and are refused as busy.
            await sandbox.files.remove("big")
            await sandbox.files.write("w/after.txt", "x")
            deadline = time.monotonic() + 30
            while not any(event.name == "after.txt" for event in seen):
                assert time.monotonic() < deadline, f"no event for after.txt: {seen}"
                await asyncio.sleep(0.1)
        finally:
            await handle.stop()
    finally:
        await sandbox.kill()
    assert f"e2b watch of sandbox {sandbox.sandbox_id}: a poll skipped, session busy" in (
        served.log()
    ), "no poll found the session busy: the test did not make the case it is about"
