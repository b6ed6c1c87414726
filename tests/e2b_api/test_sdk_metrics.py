"""``Sandbox.get_metrics`` (E2B's ``GET /sandboxes/{id}/metrics``) with the real SDK.

The runner samples its session every ``SANDCELL_RUNNER_METRICS_INTERVAL_S`` (1 s
here, 5 s by default, as E2B); the tests wait for samples by polling, never by a
fixed sleep.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxMetrics
from e2b.exceptions import NotFoundException, SandboxException

from tests.e2b_api.conftest import KEY_A, KEY_B, E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers

MIB = 1024 * 1024
# 64 MiB held and one CPU kept busy until the process is killed.
HOG = (
    "python3 -c 'b = bytearray(64 << 20)\n"
    "for i in range(len(b) // 4096): b[i * 4096] = 1\n"
    "while True: pass'"
)


@pytest.fixture(scope="module")
def served() -> Iterator[E2bServe]:
    with traversable_dir("e2b-metrics-") as base:
        service = start_serve(base, env={"SANDCELL_RUNNER_METRICS_INTERVAL_S": "1"})
        try:
            yield service
        finally:
            stop_serve(service)
            assert not stop_leftovers(service.runtime_dir)


@pytest.fixture
def sbx(served: E2bServe) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(**served.opts())
    try:
        yield sandbox
    finally:
        sandbox.kill()


def _until(
    sandbox: Sandbox, wanted: str, ok: Callable[[list[SandboxMetrics]], bool]
) -> list[SandboxMetrics]:
    """``get_metrics()`` polled until ``ok(samples)`` holds (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        samples = sandbox.get_metrics()
        if ok(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"no sample with {wanted}: {samples}")
        time.sleep(0.25)


def test_a_busy_sandbox_reports_its_cpu_memory_and_disk(sbx: Sandbox) -> None:
    """A process holding 64 MiB and a busy CPU shows in the samples, with the sandbox's
    totals: its memory limit, its workspace's size and its CPU quota."""
    sbx.files.write("data.bin", b"x" * (2 * MIB))
    hog = sbx.commands.run(HOG, background=True)
    try:

        def busy(samples: list[SandboxMetrics]) -> bool:
            return any(s.mem_used >= 48 * MIB and s.cpu_used_pct > 10 for s in samples)

        samples = _until(sbx, "64 MiB used and a busy CPU", busy)
    finally:
        hog.kill()
    assert samples == sorted(samples, key=lambda s: s.timestamp)
    for s in samples:
        assert s.cpu_count >= 1
        assert 0 <= s.cpu_used_pct <= 100
        assert s.mem_total > 0
        assert s.mem_used >= 0
        assert s.mem_cache >= 0
        assert s.disk_total > 0
        assert 0 <= s.disk_used <= s.disk_total
        assert s.timestamp.tzinfo is not None
    # The create's sample came before the write (the sandbox is sampled from its start).
    assert samples[-1].disk_used >= 2 * MIB
    assert samples[-1].mem_total == 512 * MIB  # the runner's per-job memory limit
    assert samples[-1].disk_total <= 1024 * MIB  # the workspace quota, its own filesystem


def test_start_and_end_pick_the_samples_of_those_seconds(served: E2bServe, sbx: Sandbox) -> None:
    def second(sample: SandboxMetrics) -> datetime.datetime:
        return sample.timestamp.replace(microsecond=0)

    samples = _until(sbx, "samples of two seconds", lambda found: len(set(map(second, found))) > 1)
    first = second(samples[0])
    later = [s for s in samples if second(s) > first]
    picked = sbx.get_metrics(start=first, end=first)
    assert picked
    assert all(second(s) == first for s in picked)
    after = sbx.get_metrics(start=first + datetime.timedelta(seconds=1))
    assert samples[0] not in after
    assert later[0] in after
    future = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(hours=1)
    assert sbx.get_metrics(start=future) == []
    # The class method, by id, answers the same samples.
    by_id = Sandbox.get_metrics(sbx.sandbox_id, end=first, **served.opts())
    assert by_id == sbx.get_metrics(end=first)

    with pytest.raises(SandboxException, match="400: start time cannot be after end time"):
        sbx.get_metrics(start=future, end=first)
    url = f"{served.url}/e2b/sandboxes/{sbx.sandbox_id}/metrics"
    for query in ({"start": "soon"}, {"end": "-1"}, {"start": "1" * 40}, {"end": "²"}):
        answer = httpx.get(url, params=query, headers={"X-API-KEY": KEY_A})
        assert answer.status_code == 400, query
        body = answer.json()
        assert (body["code"], body["error_code"]) == (400, "bad_request"), body


async def test_the_async_sdk_reads_them_too(served: E2bServe, sbx: Sandbox) -> None:
    _until(sbx, "a sample", bool)
    sandbox = await AsyncSandbox.connect(sbx.sandbox_id, **served.opts())
    assert (await sandbox.get_metrics())[0].mem_total == 512 * MIB
    by_id = await AsyncSandbox.get_metrics(sbx.sandbox_id, **served.opts())
    assert by_id
    assert by_id[0].cpu_count >= 1


def test_another_tenant_and_an_unknown_id_get_no_samples(served: E2bServe, sbx: Sandbox) -> None:
    """As E2B's (a query of its metrics store by team and sandbox id): another API key's
    tenant gets exactly what an id nobody had gets, 200 ``[]``, not a 404."""
    assert _until(sbx, "a sample", bool)
    assert Sandbox.get_metrics(sbx.sandbox_id, **served.opts(KEY_B)) == []
    assert Sandbox.get_metrics("a" * 20, **served.opts(KEY_B)) == []
    assert Sandbox.get_metrics("a" * 20, **served.opts()) == []
    raw = [
        httpx.get(f"{served.url}/e2b/sandboxes/{sandbox_id}/metrics", headers={"X-API-KEY": KEY_B})
        for sandbox_id in (sbx.sandbox_id, "a" * 20, "not an id")
    ]
    assert [(r.status_code, r.json()) for r in raw] == [(200, [])] * 3


def test_a_killed_sandbox_answers_the_samples_it_retired(served: E2bServe, sbx: Sandbox) -> None:
    """E2B keeps a killed sandbox's metrics: after the kill its samples still answer
    (the range filter applies), to its tenant only."""
    before = _until(sbx, "two samples", lambda samples: len(samples) >= 2)
    sbx.kill()
    after = Sandbox.get_metrics(sbx.sandbox_id, **served.opts())
    assert [m.timestamp for m in after][: len(before)] == [m.timestamp for m in before]
    first = before[0].timestamp.replace(microsecond=0)
    ranged = Sandbox.get_metrics(sbx.sandbox_id, start=first, end=first, **served.opts())
    assert [m.timestamp.replace(microsecond=0) for m in ranged] == [first]
    assert Sandbox.get_metrics(sbx.sandbox_id, **served.opts(KEY_B)) == []
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, **served.opts())


def test_a_paused_then_killed_sandbox_keeps_what_its_pause_kept(served: E2bServe) -> None:
    sandbox = Sandbox.create(**served.opts())
    try:
        before = _until(sandbox, "a sample", bool)
        sandbox.pause()
    finally:
        Sandbox.kill(sandbox.sandbox_id, **served.opts())
    after = Sandbox.get_metrics(sandbox.sandbox_id, **served.opts())
    assert [m.timestamp for m in after][: len(before)] == [m.timestamp for m in before]


def test_a_paused_sandbox_keeps_its_samples(served: E2bServe, sbx: Sandbox) -> None:
    """As E2B's: the samples taken before a pause answer while it sleeps (its runner,
    and its ring, are gone) and after its resume, with the new runner's after them;
    another tenant gets none."""
    before = _until(sbx, "two samples", lambda samples: len(samples) >= 2)
    sbx.pause()
    kept = Sandbox.get_metrics(sbx.sandbox_id, **served.opts())
    assert [m.timestamp for m in kept][: len(before)] == [m.timestamp for m in before]
    # The range filter applies to the kept ones too.
    first = before[0].timestamp.replace(microsecond=0)
    ranged = Sandbox.get_metrics(sbx.sandbox_id, start=first, end=first, **served.opts())
    assert [m.timestamp.replace(microsecond=0) for m in ranged] == [first]
    assert Sandbox.get_metrics(sbx.sandbox_id, **served.opts(KEY_B)) == []
    resumed = Sandbox.connect(sbx.sandbox_id, **served.opts())
    after = _until(resumed, "a sample after the resume", lambda s: len(s) > len(kept))
    assert [m.timestamp for m in after][: len(kept)] == [m.timestamp for m in kept]
    assert after[-1].timestamp > kept[-1].timestamp
