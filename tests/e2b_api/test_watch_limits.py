"""``WatchDir`` streams (the async SDK's ``files.watch_dir``) at their limit, through the
real ``e2b`` SDK: a tenant holds at most ``MAX_WATCH_STREAMS`` at once on a worker, the
next is the SDK's ``RateLimitException`` (envd's ``RESOURCE_EXHAUSTED``), a stopped one
gives its place back, and another tenant's are counted apart. Each stream polls its
tree four times a second while it is open: before, streams cheap to open were
background work without bound (40 on an empty directory cost 0.6 CPU-s a second)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from e2b import AsyncSandbox, RateLimitException

from sandcell_orchestrator.e2b.filesystem import MAX_WATCH_STREAMS
from tests.e2b_api.conftest import KEY_B, E2bServe


async def test_a_tenant_holds_at_most_max_watch_streams(e2b_serve: E2bServe) -> None:
    """Across two sandboxes, ``MAX_WATCH_STREAMS`` watches open and the next is refused;
    tenant b opens one meanwhile; one of a's stopped, a opens one again (once the
    service has seen the stream go: at its next event or keepalive, within 15 s)."""
    first = await AsyncSandbox.create(**e2b_serve.opts())
    second = await AsyncSandbox.create(**e2b_serve.opts())
    other = await AsyncSandbox.create(**e2b_serve.opts(KEY_B))
    handles = []
    try:
        for sandbox in (first, second, other):
            await sandbox.files.make_dir("w")
        for i in range(MAX_WATCH_STREAMS):
            sandbox = first if i % 2 else second
            handles.append(await sandbox.files.watch_dir("w", on_event=lambda _: None))
        with pytest.raises(RateLimitException, match="at most 32 directory watches"):
            await first.files.watch_dir("w", on_event=lambda _: None)
        handles.append(await other.files.watch_dir("w", on_event=lambda _: None))
        await handles.pop(0).stop()
        handles.append(await _once_free(first))
    finally:
        for handle in handles:
            await handle.stop()
        for sandbox in (first, second, other):
            await sandbox.kill()


async def _once_free(sandbox: AsyncSandbox) -> Any:
    """A new watch, as soon as a place is free again (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await sandbox.files.watch_dir("w", on_event=lambda _: None)
        except RateLimitException:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
