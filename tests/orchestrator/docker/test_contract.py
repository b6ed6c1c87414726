"""The provider contract suite (tests/orchestrator/provider_contract.py), run for Docker."""

from __future__ import annotations

import pytest

from tests.orchestrator.provider_contract import CONTRACT, ContractCheck, ContractTarget


@pytest.mark.parametrize("check", CONTRACT, ids=lambda check: check.__name__)
async def test_contract(check: ContractCheck, target: ContractTarget) -> None:
    """Each contract check holds for the Docker provider on a real engine."""
    await check(target)
