"""``cpu_count`` and ``memory_mb`` of ``get_info`` and of the listings (E2B's
``cpuCount``, ``memoryMB``; ``diskSizeMB`` is on the wire only, the SDK drops it): the
sandbox's runner's limits, the figures ``get_metrics`` reports, not placeholders."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from tests.e2b_api.conftest import E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def served() -> Iterator[E2bServe]:
    with traversable_dir("e2b-limits-") as base:
        service = start_serve(
            base,
            env={
                "SANDCELL_RUNNER_CPU_MILLICORES": "1500",
                "SANDCELL_RUNNER_MEMORY_MIB": "384",
                "SANDCELL_RUNNER_WORKSPACE_QUOTA_MIB": "200",
            },
        )
        try:
            yield service
        finally:
            stop_serve(service)
            assert not stop_leftovers(service.runtime_dir)


def _wire(served: E2bServe, path: str) -> object:
    answer = httpx.get(f"{served.url}/e2b{path}", headers={"X-API-KEY": served.opts()["api_key"]})
    answer.raise_for_status()
    return answer.json()


def test_info_and_listings_give_the_runners_limits(served: E2bServe) -> None:
    opts = served.opts()
    sandbox = Sandbox.create(**opts)
    try:
        info = sandbox.get_info()
        # 1.5 CPUs of quota count as 2, as a metrics sample counts them.
        assert (info.cpu_count, info.memory_mb) == (2, 384)
        sample = sandbox.get_metrics()[-1]
        assert (sample.cpu_count, sample.mem_total // MIB) == (2, 384)
        detail = _wire(served, f"/sandboxes/{sandbox.sandbox_id}")
        assert isinstance(detail, dict)
        assert detail["diskSizeMB"] == sample.disk_total // MIB
        assert 0 < detail["diskSizeMB"] <= 200
        for listed in (
            Sandbox.list(**opts).next_items(),
            Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING]), **opts).next_items(),
        ):
            mine = [s for s in listed if s.sandbox_id == sandbox.sandbox_id]
            assert [(s.cpu_count, s.memory_mb) for s in mine] == [(2, 384)]
        v1 = _wire(served, "/sandboxes")
        assert isinstance(v1, list)
        assert [
            (s["cpuCount"], s["memoryMB"], s["diskSizeMB"])
            for s in v1
            if s["sandboxID"] == sandbox.sandbox_id
        ] == [(2, 384, detail["diskSizeMB"])]
        # A paused sandbox keeps them (its row does), as E2B lists its template's.
        sandbox.pause()
        paused = Sandbox.get_info(sandbox.sandbox_id, **opts)
        assert (paused.cpu_count, paused.memory_mb) == (2, 384)
    finally:
        sandbox.kill()
