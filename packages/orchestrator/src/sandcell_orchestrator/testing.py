"""Test doubles for code that embeds sandcell (and for sandcell's own tests).

Each double wraps a real component and changes one behaviour, so a test drives
the real lifecycle into a corner that is hard to reach otherwise:

    SilentRenewRegistry   a paused worker: its renewals never reach the registry
    LosingRenewRegistry   a worker whose lease was taken: every renewal says so
    GatedProvider         ``create`` launches, then waits until the test opens a gate

and two helpers for tests that start sandcell processes:

    clean_environ(**overrides)      this process's environment without SANDCELL_*
    sandbox_processes(runtime_dir)  live processes of sandboxes under a directory

Nothing here is imported by sandcell itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

import psutil

from .handle import SandboxHandle
from .providers.base import SandboxProvider, SandboxSpec
from .registry import Lease, SessionRegistry

__all__ = [
    "GatedProvider",
    "LosingRenewRegistry",
    "SilentRenewRegistry",
    "clean_environ",
    "sandbox_processes",
]


class SilentRenewRegistry:
    """A paused worker's view of a registry: renewals "succeed" locally, never reaching it.

    The lock then expires in the real registry while the worker believes it holds
    it, which is what a GC pause, a SIGSTOP or a partition does.
    """

    def __init__(self, inner: SessionRegistry) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        return True


class LosingRenewRegistry:
    """Every renewal reports the lease lost (its token is no longer ours)."""

    def __init__(self, inner: SessionRegistry) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        return False


class GatedProvider:
    """A provider whose ``create`` launches, records the sandbox, then waits for ``gate``.

    Everything else goes to the wrapped provider unchanged.
    """

    def __init__(self, inner: SandboxProvider) -> None:
        self._inner = inner
        self.gate = asyncio.Event()
        self.created: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        handle = await self._inner.create(spec)
        self.created.append(handle.sandbox_id)
        await self.gate.wait()
        return handle

    async def wait_created(self, caller: asyncio.Task[object], *, timeout_s: float = 120) -> str:
        """The first sandbox ``create`` made; the error of ``caller`` if it ended first."""
        async with asyncio.timeout(timeout_s):
            while not self.created:
                if caller.done():
                    caller.result()
                    raise AssertionError("the caller ended without creating a sandbox")
                await asyncio.sleep(0.05)
        return self.created[0]


def clean_environ(env: Mapping[str, str] | None = None, /, **overrides: str) -> dict[str, str]:
    """``env`` (default: this process's) without any ``SANDCELL_*`` variable, plus overrides."""
    source = os.environ if env is None else env
    cleaned = {k: v for k, v in source.items() if not k.startswith("SANDCELL_")}
    cleaned.update(overrides)
    return cleaned


def sandbox_processes(runtime_dir: Path) -> list[psutil.Process]:
    """Live processes started for sandboxes under ``runtime_dir`` (runners and their jails):
    those whose command line or environment names it."""
    marker = str(runtime_dir)
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(process.cmdline()) or any(
                marker in value for value in process.environ().values()
            ):
                found.append(process)
    return found
