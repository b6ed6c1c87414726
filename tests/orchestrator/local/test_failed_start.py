"""A runner that exits while starting fails its create at once, in its own words."""

from __future__ import annotations

import asyncio

import pytest

from sandcell_orchestrator.errors import SandboxUnavailableError
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from tests.fixtures.paths import traversable_dir


async def test_a_runner_that_refuses_its_configuration_fails_the_create_at_once() -> None:
    """It exits 2 as it starts. The create is not kept waiting for the ready timeout
    (ten minutes here): it fails with the runner's own words from its log."""
    with traversable_dir("start-") as root:
        provider = LocalProvider(
            LocalSettings(
                runtime_dir=root / "rt",
                ready_timeout_s=600,
                runner_env={"SANDCELL_RUNNER_TIMEOUT_MS": "soon"},
            )
        )
        try:
            with pytest.raises(SandboxUnavailableError) as caught:
                # A bound for a loaded machine, far below the ready timeout.
                async with asyncio.timeout(120):
                    await provider.create(SandboxSpec())
            assert "SANDCELL_RUNNER_TIMEOUT_MS" in str(caught.value)
        finally:
            await provider.close()


async def test_a_failed_start_leaves_no_runner_root() -> None:
    """A runner that exits as it starts leaves nothing under the runtime directory: no
    ``sandbox.json`` names its root, so nothing but a sweeper (``sandcell exec`` has
    none) would ever remove it, and every failed start used to leave one."""
    with traversable_dir("start-") as root:
        runtime = root / "rt"
        provider = LocalProvider(
            LocalSettings(runtime_dir=runtime, runner_env={"SANDCELL_RUNNER_TIMEOUT_MS": "soon"})
        )
        try:
            for _ in range(2):
                with pytest.raises(SandboxUnavailableError):
                    async with asyncio.timeout(120):
                        await provider.create(SandboxSpec())
            assert sorted(path.name for path in runtime.iterdir()) == []
        finally:
            await provider.close()


async def test_an_interpreter_that_cannot_run_is_unavailable_and_leaves_no_root() -> None:
    """A configured runner interpreter that does not exist: the create fails as the
    sandbox being unavailable (a provider error the service maps, not a bare OSError
    it answers as a 500), and its root is gone."""
    with traversable_dir("start-") as root:
        runtime = root / "rt"
        provider = LocalProvider(
            LocalSettings(runtime_dir=runtime, python=str(root / "no-such-python"))
        )
        try:
            with pytest.raises(SandboxUnavailableError, match="could not start"):
                await provider.create(SandboxSpec())
            assert list(runtime.iterdir()) == []
        finally:
            await provider.close()
