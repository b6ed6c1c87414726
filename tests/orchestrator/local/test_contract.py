"""The provider contract suite (tests/orchestrator/provider_contract.py), for local runners."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.provider_contract import CONTRACT, ContractCheck, ContractTarget


@pytest.fixture
async def target() -> AsyncIterator[ContractTarget]:
    with traversable_dir("contract-") as root:
        async with DirectorySnapshotStore(root / "snapshots") as store:
            settings = LocalSettings(runtime_dir=root / "rt")
            contract = ContractTarget(
                make_provider=lambda: LocalProvider(settings),
                store=store,
                missing_sandbox_id="local-0000000000000000",
            )
            try:
                yield contract
            finally:
                await contract.close()


@pytest.mark.parametrize("check", CONTRACT, ids=lambda check: check.__name__)
async def test_contract(check: ContractCheck, target: ContractTarget) -> None:
    """Each contract check holds for local runner processes."""
    await check(target)
