"""ExecutionService with real local runners: state across destruction, contention, faults."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterable
from pathlib import Path

import pytest

from sandcell_orchestrator.errors import (
    CheckpointError,
    LockLostError,
    SandboxUnavailableError,
    SessionBusyError,
    SessionRequiredError,
)
from sandcell_orchestrator.providers.local import LocalProvider
from sandcell_orchestrator.registry import InProcessRegistry, SessionRegistry
from sandcell_orchestrator.sessions.execution import ExecutionService, Identity
from sandcell_orchestrator.snapshots import S3SnapshotStore, SnapshotInfo, SnapshotStore
from sandcell_orchestrator.testing import GatedProvider, LosingRenewRegistry, SilentRenewRegistry
from sandcell_protocol import (
    ExecuteRequest,
    ExecuteResult,
    parse_checkpoint_key,
    runtime_session_id,
)
from tests.orchestrator.sessions.conftest import S3_SECRET, S3Server, current_key, runner_pids

ALICE = Identity("tenant-a", "alice")


def py(code: str, **fields: object) -> ExecuteRequest:
    return ExecuteRequest(language="python", code=code, **fields)  # type: ignore[arg-type]


async def test_state_survives_sandbox_destruction(
    local_provider: LocalProvider, store: SnapshotStore, runtime_dir: Path
) -> None:
    """Checkpoint -> destroy -> restore, with each snapshot store."""
    first = ExecutionService(provider=local_provider, registry=InProcessRegistry(), store=store)
    result = await first.execute(
        py("import os\nos.makedirs('d')\nopen('d/state.txt','w').write('kept')"), ALICE, hint="h1"
    )
    assert result.status == "ok"
    session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "h1")
    key = await current_key(first, session_id)
    assert parse_checkpoint_key(key) is not None
    assert await store.exists(key)
    await first.aclose(destroy_sandboxes=True)
    assert runner_pids(runtime_dir) == []
    # A new service with an empty registry (a new process): launch + restore.
    second = ExecutionService(provider=local_provider, registry=InProcessRegistry(), store=store)
    again = await second.execute(py("print(open('d/state.txt').read())"), ALICE, hint="h1")
    assert again.stdout == "kept\n"
    assert second.metrics.value("sandcell_restores_total", outcome="ok") == 1
    await second.aclose(destroy_sandboxes=True)


async def test_warm_session_reuses_one_sandbox(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    service = ExecutionService(
        provider=local_provider, registry=InProcessRegistry(), store=dir_store
    )
    for i in range(3):
        result = await service.execute(
            py(f"open('t{i}','w').write('x'); import os; print(len(os.listdir()))"),
            ALICE,
            hint="warm",
        )
        assert result.stdout == f"{i + 1}\n"
    assert service.metrics.value("sandcell_launches_total", outcome="ok") == 1
    assert len(runner_pids(runtime_dir)) == 1
    unchanged = await service.execute(py("print('no change')"), ALICE, hint="warm")
    assert unchanged.workspace_changed is False
    assert service.metrics.value("sandcell_checkpoints_total", outcome="unchanged") == 1
    await service.aclose(destroy_sandboxes=True)


async def test_concurrent_turns_one_runs_one_busy(
    local_provider: LocalProvider,
    dir_store: SnapshotStore,
    registry: SessionRegistry,
    runtime_dir: Path,
) -> None:
    """Two workers, one session: one runs, the other gets SessionBusyError; one sandbox."""
    worker_a = ExecutionService(provider=local_provider, registry=registry, store=dir_store)
    worker_b = ExecutionService(provider=local_provider, registry=registry, store=dir_store)
    slow = asyncio.create_task(
        worker_a.execute(py("import time; time.sleep(2); print('a')"), ALICE, hint="c")
    )
    await asyncio.sleep(0.3)
    with pytest.raises(SessionBusyError) as info:
        await worker_b.execute(py("print('b')"), ALICE, hint="c")
    assert info.value.retryable
    assert (await slow).stdout == "a\n"
    assert len(runner_pids(runtime_dir)) == 1
    assert worker_b.metrics.value("sandcell_lock_contention_total") == 1
    await worker_a.aclose(destroy_sandboxes=True)


async def _when_free(
    service: ExecutionService, request: ExecuteRequest, *, hint: str
) -> ExecuteResult:
    """Run ``request`` as soon as the session's lock is free (bounded)."""
    async with asyncio.timeout(120):
        while True:
            try:
                return await service.execute(request, ALICE, hint=hint)
            except SessionBusyError:
                await asyncio.sleep(0.1)


async def test_lock_expiry_fences_stale_worker(
    local_provider: LocalProvider,
    dir_store: SnapshotStore,
    registry: SessionRegistry,
    runtime_dir: Path,
) -> None:
    """A worker whose lease expired mid-launch cannot write its record; its sandbox is destroyed."""
    gated = GatedProvider(local_provider)
    stale = ExecutionService(
        provider=gated,  # type: ignore[arg-type]
        registry=SilentRenewRegistry(registry),  # type: ignore[arg-type]
        store=dir_store,
    )
    # Long enough that a loaded machine's stalls do not end the lease locally first.
    stale.manager.lock_ttl_ms = 2000
    fresh = ExecutionService(provider=local_provider, registry=registry, store=dir_store)
    stale_turn = asyncio.create_task(stale.execute(py("print('stale')"), ALICE, hint="f"))
    await gated.wait_created(stale_turn)
    # The fresh worker gets in once the stale lease has expired in the registry.
    result = await _when_free(fresh, py("print('fresh')"), hint="f")
    assert result.stdout == "fresh\n"
    gated.gate.set()
    with pytest.raises(LockLostError):
        await stale_turn
    session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "f")
    record = await registry.get(session_id)
    assert record is not None
    assert record.sandbox_id != gated.created[0]
    # The stale worker's sandbox is gone; only the fresh worker's runner remains.
    assert len(runner_pids(runtime_dir)) == 1
    await fresh.aclose(destroy_sandboxes=True)


async def test_lost_renewal_cancels_the_turn(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    service = ExecutionService(
        provider=local_provider,
        registry=LosingRenewRegistry(InProcessRegistry()),  # type: ignore[arg-type]
        store=dir_store,
    )
    service.manager.lock_ttl_ms = 600
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(LockLostError):
        await service.execute(py("import time; time.sleep(30)", timeout_ms=60_000), ALICE, hint="l")
    assert loop.time() - started < 15
    # The sandbox that may still run the job was recycled, not kept.
    for _ in range(50):
        if not runner_pids(runtime_dir):
            break
        await asyncio.sleep(0.1)
    assert runner_pids(runtime_dir) == []


async def test_s3_down_during_checkpoint_returns_result(
    local_provider: LocalProvider, s3_server: S3Server
) -> None:
    async with S3SnapshotStore(s3_server.settings("cp-down")) as store:
        # A short retry budget: S3 stays down past it, so the turn gives up on saving.
        service = ExecutionService(
            provider=local_provider,
            registry=InProcessRegistry(),
            store=store,
            checkpoint_retry_s=3,
        )
        first = await service.execute(py("open('v','w').write('1')"), ALICE, hint="s")
        assert first.durable is True
        session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "s")
        before = await current_key(service, session_id)
        s3_server.stop()
        try:
            result = await service.execute(
                py("open('v','w').write('2'); print('ran')"), ALICE, hint="s"
            )
            assert result.stdout == "ran\n"
            # The answer tells the truth: this turn is not in any checkpoint yet.
            assert result.durable is False
            record = await service.manager.record(session_id)
            assert record is not None
            assert record.unsaved
            failed = service.metrics.value("sandcell_checkpoints_total", outcome="failed")
            assert failed >= 2  # the first attempt and at least one retry
            assert service.metrics.value("sandcell_checkpoint_retries_total") == failed - 1
        finally:
            s3_server.start()
        # The record still points at the previous checkpoint, which is intact.
        assert await current_key(service, session_id) == before
        assert await store.exists(before)
        await service.aclose(destroy_sandboxes=True)


async def test_checkpoint_retried_through_a_short_s3_outage(
    local_provider: LocalProvider, s3_server: S3Server, runtime_dir: Path
) -> None:
    async with S3SnapshotStore(s3_server.settings("cp-retry")) as store:
        service = ExecutionService(
            provider=local_provider, registry=InProcessRegistry(), store=store
        )
        await service.execute(py("open('v','w').write('1')"), ALICE, hint="t")
        session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "t")
        before = await current_key(service, session_id)
        s3_server.stop()

        async def back_after_a_failure() -> None:
            # S3 comes back once a checkpoint attempt failed: well inside the default
            # 10 s retry budget.
            while not service.metrics.value("sandcell_checkpoints_total", outcome="failed"):
                await asyncio.sleep(0.05)
            s3_server.start()

        restart = asyncio.ensure_future(back_after_a_failure())
        try:
            await service.execute(py("open('v','w').write('2')"), ALICE, hint="t")
        finally:
            restart.cancel()  # a no-op once S3 is back (the fixture stops it anyway)
        assert service.metrics.value("sandcell_checkpoint_retries_total") >= 1
        after = await current_key(service, session_id)
        assert after is not None
        assert after != before
        # The saved turn survives the sandbox: a new one restores it.
        (pid,) = runner_pids(runtime_dir)
        os.killpg(pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        again = await service.execute(py("print(open('v').read())"), ALICE, hint="t")
        assert again.stdout == "2\n"
        await service.aclose(destroy_sandboxes=True)


async def test_turn_after_a_failed_checkpoint_saves_even_if_unchanged(
    local_provider: LocalProvider, s3_server: S3Server, runtime_dir: Path
) -> None:
    """The unsaved mark is in the record: the next turn saves on whichever worker takes
    it (here a second service on the same registry, reusing the warm sandbox), and
    answers durable, even though that turn changes nothing."""
    registry = InProcessRegistry()
    async with S3SnapshotStore(s3_server.settings("cp-unsaved")) as store:
        service = ExecutionService(
            provider=local_provider, registry=registry, store=store, checkpoint_retry_s=0
        )
        other = ExecutionService(provider=local_provider, registry=registry, store=store)
        await service.execute(py("open('v','w').write('1')"), ALICE, hint="u")
        session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "u")
        before = await current_key(service, session_id)
        s3_server.stop()
        try:
            unsaved = await service.execute(py("open('v','w').write('2')"), ALICE, hint="u")
        finally:
            s3_server.start()
        assert unsaved.durable is False
        assert await current_key(service, session_id) == before
        # This turn changes nothing, but the sandbox holds the unsaved turn: it saves.
        read = await other.execute(py("print(open('v').read())"), ALICE, hint="u")
        assert read.stdout == "2\n"
        assert read.durable is True
        assert await current_key(service, session_id) != before
        assert other.metrics.value("sandcell_checkpoints_total", outcome="unchanged") == 0
        record = await registry.get(session_id)
        assert record is not None
        assert not record.unsaved
        # Saved, the mark is gone: the next unchanged turn skips the checkpoint.
        again = await service.execute(py("print(open('v').read())"), ALICE, hint="u")
        assert again.durable is True
        assert service.metrics.value("sandcell_checkpoints_total", outcome="unchanged") == 1
        (pid,) = runner_pids(runtime_dir)
        os.killpg(pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        again = await service.execute(py("print(open('v').read())"), ALICE, hint="u")
        assert again.stdout == "2\n"
        await other.aclose(destroy_sandboxes=False)
        await service.aclose(destroy_sandboxes=True)


class RunnerKillingStore:
    """A snapshot store whose next ``put`` finds the session's runner killed (as by a
    SIGKILL between execute and checkpoint) and fails."""

    def __init__(self, inner: SnapshotStore, runtime_dir: Path) -> None:
        self._inner = inner
        self._runtime_dir = runtime_dir
        self.kill_next = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def put(self, key: str, stream: AsyncIterable[bytes], *, max_bytes: int) -> SnapshotInfo:
        if not self.kill_next:
            return await self._inner.put(key, stream, max_bytes=max_bytes)
        self.kill_next = False
        victims = runner_pids(self._runtime_dir)
        for pid in victims:
            os.killpg(pid, signal.SIGKILL)
        while any(pid in runner_pids(self._runtime_dir) for pid in victims):
            await asyncio.sleep(0.05)
        raise CheckpointError(f"snapshot put of {key!r} failed: the stream broke")


async def test_a_dead_runners_checkpoint_is_not_retried(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    """The runner dies before its checkpoint is saved: the turn answers at once, not
    durable, without spending the retry budget on a runner that is gone; the next turn
    restores the last checkpoint (the answer had said the turn was not saved)."""
    store = RunnerKillingStore(dir_store, runtime_dir)
    service = ExecutionService(
        provider=local_provider,
        registry=InProcessRegistry(),
        store=store,  # type: ignore[arg-type]
        checkpoint_retry_s=60,
    )
    await service.execute(py("open('v','w').write('1')"), ALICE, hint="k")
    store.kill_next = True
    lost = await service.execute(py("open('v','w').write('2')"), ALICE, hint="k")
    assert lost.durable is False
    assert service.metrics.value("sandcell_checkpoint_retries_total") == 0
    again = await service.execute(py("print(open('v').read())"), ALICE, hint="k")
    assert again.stdout == "1\n"
    assert again.durable is True
    await service.aclose(destroy_sandboxes=True)


async def test_s3_down_during_restore_is_retryable_and_turn_does_not_run(
    local_provider: LocalProvider, s3_server: S3Server, runtime_dir: Path
) -> None:
    async with S3SnapshotStore(s3_server.settings("rs-down")) as store:
        first = ExecutionService(provider=local_provider, registry=InProcessRegistry(), store=store)
        await first.execute(py("open('v','w').write('1')"), ALICE, hint="r")
        await first.aclose(destroy_sandboxes=True)
        marker = runtime_dir / "turn-ran"
        second = ExecutionService(
            provider=local_provider, registry=InProcessRegistry(), store=store
        )
        s3_server.stop()
        try:
            with pytest.raises(SandboxUnavailableError) as info:
                await second.execute(py(f"open({str(marker)!r}, 'w')"), ALICE, hint="r")
            assert info.value.retryable
        finally:
            s3_server.start()
        assert not marker.exists()
        assert runner_pids(runtime_dir) == []
        again = await second.execute(py("print(open('v').read())"), ALICE, hint="r")
        assert again.stdout == "1\n"
        await second.aclose(destroy_sandboxes=True)


async def test_runner_killed_between_turns_relaunches_and_restores(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    service = ExecutionService(
        provider=local_provider, registry=InProcessRegistry(), store=dir_store
    )
    await service.execute(py("open('f','w').write('survives')"), ALICE, hint="k")
    (pid,) = runner_pids(runtime_dir)
    os.killpg(pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    result = await service.execute(py("print(open('f').read())"), ALICE, hint="k")
    assert result.stdout == "survives\n"
    assert service.metrics.value("sandcell_fallbacks_total", reason="sandbox_lost") == 1
    await service.aclose(destroy_sandboxes=True)


async def test_corrupt_record_reads_as_missing(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    registry = InProcessRegistry()
    service = ExecutionService(provider=local_provider, registry=registry, store=dir_store)
    await service.execute(py("open('f','w').write('x')"), ALICE, hint="c")
    session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "c")
    registry._records[session_id] = b"{not json"  # what a corrupted store returns
    result = await service.execute(py("print(open('f').read())"), ALICE, hint="c")
    # Treated as missing: a new sandbox, restored from the checkpoint; the old one,
    # which no record points at any more, is not left running.
    assert result.stdout == "x\n"
    assert len(runner_pids(runtime_dir)) == 1
    await service.aclose(destroy_sandboxes=True)


async def test_stateless_cleans_up_on_cancel(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    service = ExecutionService(
        provider=local_provider, registry=InProcessRegistry(), store=dir_store, mode="stateless"
    )
    task = asyncio.create_task(service.execute(py("import time; time.sleep(30)"), ALICE))
    while not runner_pids(runtime_dir):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        if not runner_pids(runtime_dir):
            break
        await asyncio.sleep(0.1)
    assert runner_pids(runtime_dir) == []
    assert list((runtime_dir / "rt").iterdir()) == []


async def test_affinity_without_hint_runs_stateless_strict_refuses(
    local_provider: LocalProvider, dir_store: SnapshotStore
) -> None:
    affinity = ExecutionService(
        provider=local_provider, registry=InProcessRegistry(), store=dir_store
    )
    result = await affinity.execute(py("print('anon')"), ALICE)
    assert result.stdout == "anon\n"
    assert affinity.metrics.value("sandcell_fallbacks_total", reason="no_hint") == 1
    strict = ExecutionService(
        provider=local_provider, registry=InProcessRegistry(), store=dir_store, mode="strict"
    )
    with pytest.raises(SessionRequiredError):
        await strict.execute(py("print(1)"), ALICE)


async def test_no_secret_in_logs_or_errors(
    local_provider: LocalProvider,
    s3_server: S3Server,
    runtime_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    errors: list[str] = []
    async with S3SnapshotStore(s3_server.settings("secrets")) as store:
        service = ExecutionService(
            provider=local_provider, registry=InProcessRegistry(), store=store
        )
        await service.execute(py("print(1)"), ALICE, hint="sec")
        tokens = [
            json.loads(p.read_text())["token"] for p in (runtime_dir / "rt").glob("*/sandbox.json")
        ]
        s3_server.stop()
        try:
            await service.execute(py("open('x','w')"), ALICE, hint="sec")
            await service.aclose(destroy_sandboxes=True)
            fresh = ExecutionService(
                provider=local_provider, registry=InProcessRegistry(), store=store
            )
            try:
                await fresh.execute(py("1"), ALICE, hint="sec")
            except Exception as exc:
                errors += [str(exc), repr(exc), str(exc.__cause__), repr(exc.__cause__)]
            finally:
                await fresh.aclose(destroy_sandboxes=True)
        finally:
            s3_server.start()
    assert tokens
    text = caplog.text + "\n".join(errors)
    for secret in [*tokens, S3_SECRET]:
        assert secret not in text


async def test_idle_sweeper_suspends_and_forgets_lost_sandboxes(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    registry = InProcessRegistry()
    service = ExecutionService(provider=local_provider, registry=registry, store=dir_store)
    await service.execute(py("open('a','w').write('1')"), ALICE, hint="idle")
    await service.execute(py("open('b','w').write('2')"), ALICE, hint="gone")
    idle_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "idle")
    gone_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "gone")
    await registry.touch(gone_id, at_s=service.manager._now() + 3600)  # recently seen: not idle
    gone = await registry.get(gone_id)
    assert gone is not None
    # The runner dies behind the registry's back; its root (and tmpfs mount) stays.
    gone_root = runtime_dir / "rt" / gone.sandbox_id
    state = json.loads((gone_root / "sandbox.json").read_text())
    os.kill(int(state["pid"]), signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(int(state["pid"]), 0)
    # A forked runner is the zygote's child, not ours: it is dead only once the kernel
    # has torn it down (a zombie, or reaped). Before that the sweep rightly sees it alive.
    await _until_dead(int(state["pid"]))
    suspended = await service.sweep_idle(idle_s=60)
    assert suspended == 0  # nothing idle for a minute yet
    idle_record = await registry.get(idle_id)
    gone_record = await registry.get(gone_id)
    assert idle_record is not None
    assert idle_record.state == "active"
    assert gone_record is not None
    assert gone_record.state == "suspended"
    assert not gone_root.exists()  # the remains were destroyed
    assert await service.sweep_idle(idle_s=0.001) == 1
    idle_record = await registry.get(idle_id)
    assert idle_record is not None
    assert idle_record.state == "suspended"
    assert runner_pids(runtime_dir) == []
    again = await service.execute(py("print(open('a').read())"), ALICE, hint="idle")
    assert again.stdout == "1\n"
    await service.aclose(destroy_sandboxes=True)


async def test_each_sweep_checks_a_bounded_share_of_the_rows(
    local_provider: LocalProvider, dir_store: SnapshotStore
) -> None:
    """Rows whose sandbox is lost are found round robin, a bounded number per sweep."""
    registry = InProcessRegistry()
    service = ExecutionService(provider=local_provider, registry=registry, store=dir_store)
    service.manager.sweeper.lost_checks_per_sweep = 2
    hints = ["one", "two", "three"]
    for hint in hints:
        await service.execute(py("print(1)"), ALICE, hint=hint)
    ids = [runtime_session_id(ALICE.namespace, ALICE.user_id, hint) for hint in hints]
    for session_id in ids:
        record = await registry.get(session_id)
        assert record is not None
        await local_provider.destroy(record.sandbox_id)

    async def states() -> list[str]:
        found = [await registry.get(session_id) for session_id in ids]
        return sorted(record.state for record in found if record is not None)

    assert await service.sweep_idle(idle_s=3600) == 0
    assert await states() == ["active", "suspended", "suspended"]
    await service.sweep_idle(idle_s=3600)
    assert await states() == ["suspended", "suspended", "suspended"]
    await service.aclose(destroy_sandboxes=True)


async def test_a_failing_destroy_skips_one_row_not_the_round(
    local_provider: LocalProvider, dir_store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = InProcessRegistry()
    service = ExecutionService(provider=local_provider, registry=registry, store=dir_store)
    hints = ["stuck", "fine"]
    for hint in hints:
        await service.execute(py("print(1)"), ALICE, hint=hint)
    records = [
        await registry.get(runtime_session_id(ALICE.namespace, ALICE.user_id, hint))
        for hint in hints
    ]
    stuck, fine = (record for record in records if record is not None)
    for record in (stuck, fine):
        await local_provider.destroy(record.sandbox_id)
    destroy = local_provider.destroy

    async def flaky_destroy(sandbox_id: str) -> None:
        if sandbox_id == stuck.sandbox_id:
            raise SandboxUnavailableError("the engine is not answering")
        await destroy(sandbox_id)

    monkeypatch.setattr(local_provider, "destroy", flaky_destroy)
    await service.sweep_idle(idle_s=3600)
    after = {r.session_id: r.state for r in await registry.list_records()}
    assert after == {stuck.session_id: "active", fine.session_id: "suspended"}
    monkeypatch.setattr(local_provider, "destroy", destroy)
    await service.sweep_idle(idle_s=3600)  # the stuck row is looked at again
    stuck_now = await registry.get(stuck.session_id)
    assert stuck_now is not None
    assert stuck_now.state == "suspended"
    await service.aclose(destroy_sandboxes=True)


async def _until_dead(pid: int) -> None:
    import psutil

    async with asyncio.timeout(30):
        while True:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return
            except psutil.NoSuchProcess:
                return
            await asyncio.sleep(0.02)
