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
