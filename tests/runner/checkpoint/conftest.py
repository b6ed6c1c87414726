"""Fixtures for checkpoint archive tests (real filesystem, run as root)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.runner.checkpoint import Arena, make_arena


@pytest.fixture(autouse=True)
def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("archive tests extract as another UID and need root (run scripts/test as root)")


@pytest.fixture
def arena() -> Iterator[Arena]:
    with make_arena() as made:
        yield made
