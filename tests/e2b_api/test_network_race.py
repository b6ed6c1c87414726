"""A network update on one worker racing a resume (or another update) on the other:
the running sandbox ends on the newest policy its row holds, whatever the order.

Two workers' ``E2bSandboxes`` in this process (``two_workers.py``).

Each test holds one worker at its critical point, the compare-and-set of the row
(``_HeldRegistry`` is the real ``RedisRegistry`` with a gate before that one call),
lets the other worker act meanwhile, then releases it. The policy checked is the
one the runner itself reports (``GET /v1/egress``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from sandcell_orchestrator.errors import RegistryError
from sandcell_orchestrator.registry import E2bSandboxRow, RedisRegistry
from sandcell_protocol import EgressPolicy
from tests.e2b_api.two_workers import Worker, running_sandbox, two_workers
from tests.orchestrator.conftest import S3Server, redis_url, s3_server

__all__ = ["redis_url", "s3_server"]

OWNER = "tenant-a"
OLD = EgressPolicy(mode="deny_all")
NEW = EgressPolicy(mode="allow", allow=("allowed.egress.test",))
NEWER = EgressPolicy(mode="allow_all", deny=("other.egress.test",))
_WAIT_S = 60.0
"""A bound on each wait, so a broken run fails instead of hanging (not a timing check)."""


@dataclass
class _Gate:
    """Holds the first row write ``matches`` picks: ``held`` is set when it arrives,
    and it goes on to Redis once ``release`` is set."""

    matches: Callable[[E2bSandboxRow], bool]
    held: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


class _HeldRegistry(RedisRegistry):
    """The real Redis registry; a gate set with ``hold`` stops one E2B row write
    (``update_e2b_sandbox``, the compare-and-set) just before it is sent."""

    _gate: _Gate | None = None
    _failing: Callable[[E2bSandboxRow], bool] | None = None

    def hold(self, matches: Callable[[E2bSandboxRow], bool]) -> _Gate:
        self._gate = _Gate(matches)
        return self._gate

    def fail(self, matches: Callable[[E2bSandboxRow], bool]) -> None:
        """The first row write ``matches`` picks raises, as a registry outage does."""
        self._failing = matches

    async def update_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        failing = self._failing
        if failing is not None and failing(row):
            self._failing = None
            raise RegistryError("the registry is unreachable (the test's outage)")
        gate = self._gate
        if gate is not None and gate.matches(row):
            self._gate = None
            gate.held.set()
            await gate.release.wait()
        return await super().update_e2b_sandbox(row)


_Worker = Worker[_HeldRegistry]


@pytest.fixture
async def workers(redis_url: str, s3_server: S3Server) -> AsyncIterator[tuple[_Worker, _Worker]]:
    async with two_workers(_HeldRegistry, redis_url, s3_server, name="e2b-race-") as pair:
        yield pair


async def _paused_sandbox(one: _Worker) -> str:
    made = await running_sandbox(one, OWNER, egress=OLD)
    assert await one.sandboxes.pause(made) is True
    return made.sandbox_id


async def _enforced(worker: _Worker, sandbox_id: str) -> EgressPolicy:
    """The policy the sandbox's running runner reports, and the row's."""
    sandbox = await worker.sandboxes.get(sandbox_id, owner=OWNER)
    assert sandbox.state == "running"
    status = await worker.manager.egress_status(sandbox.session_id)
    assert sandbox.row.egress == status.policy, (sandbox.row.egress, status.policy)
    return status.policy


async def _while_held(gate: _Gate, held: asyncio.Task[object]) -> None:
    """Wait until ``held`` is stopped at ``gate`` (failing if it ended instead)."""
    stopped = asyncio.create_task(gate.held.wait())
    await asyncio.wait({stopped, held}, timeout=_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    assert gate.held.is_set(), held.exception() if held.done() else "never reached the gate"


async def _released(gate: _Gate, held: asyncio.Task[object]) -> None:
    gate.release.set()
    async with asyncio.timeout(_WAIT_S):
        await held


async def test_an_update_lands_while_the_other_worker_resumes_with_the_old_spec(
    workers: tuple[_Worker, _Worker],
) -> None:
    """Worker two's resume launches the sandbox with the old policy and is held before
    its row write; worker one's update reads "paused", writes the row and returns (the
    200); when two's write lands it meets the new row: the runner ends on the new policy."""
    one, two = workers
    sandbox_id = await _paused_sandbox(one)
    try:
        resuming = await two.sandboxes.get(sandbox_id, owner=OWNER)
        gate = two.registry.hold(lambda row: row.state == "running")
        resume = asyncio.create_task(two.sandboxes.connect(resuming, timeout_s=None))
        await _while_held(gate, resume)

        updating = await one.sandboxes.get(sandbox_id, owner=OWNER)
        assert updating.state == "paused"
        await one.sandboxes.set_network(updating, NEW)

        await _released(gate, resume)
        assert await _enforced(two, sandbox_id) == NEW
        assert await _enforced(one, sandbox_id) == NEW
    finally:
        await one.sandboxes.kill(await one.sandboxes.get(sandbox_id, owner=OWNER))


async def test_a_resume_lands_while_the_other_worker_updates_a_paused_sandbox(
    workers: tuple[_Worker, _Worker],
) -> None:
    """Worker one's update reads "paused" (nothing to apply) and is held before its row
    write; worker two resumes the sandbox with the old policy, to the end; when one's
    write lands it meets a running sandbox: the runner ends on the new policy."""
    one, two = workers
    sandbox_id = await _paused_sandbox(one)
    try:
        updating = await one.sandboxes.get(sandbox_id, owner=OWNER)
        gate = one.registry.hold(lambda row: row.egress == NEW)
        update = asyncio.create_task(one.sandboxes.set_network(updating, NEW))
        await _while_held(gate, update)

        resumed = await two.sandboxes.connect(
            await two.sandboxes.get(sandbox_id, owner=OWNER), timeout_s=None
        )
        assert resumed.state == "running"
        assert (await two.manager.egress_status(resumed.session_id)).policy == OLD

        await _released(gate, update)
        assert await _enforced(one, sandbox_id) == NEW
        assert await _enforced(two, sandbox_id) == NEW
    finally:
        await one.sandboxes.kill(await one.sandboxes.get(sandbox_id, owner=OWNER))


async def test_two_updates_on_two_workers_end_on_the_one_written_last(
    workers: tuple[_Worker, _Worker],
) -> None:
    """Worker one applies its policy to the running sandbox and is held before its row
    write; worker two applies and writes another; one's write then lands last, so its
    policy is the row's and must be the runner's too (it had been overwritten there)."""
    one, two = workers
    sandbox_id = await _paused_sandbox(one)
    try:
        await one.sandboxes.connect(
            await one.sandboxes.get(sandbox_id, owner=OWNER), timeout_s=None
        )
        first = await one.sandboxes.get(sandbox_id, owner=OWNER)
        gate = one.registry.hold(lambda row: row.egress == NEW)
        update = asyncio.create_task(one.sandboxes.set_network(first, NEW))
        await _while_held(gate, update)

        await two.sandboxes.set_network(await two.sandboxes.get(sandbox_id, owner=OWNER), NEWER)

        await _released(gate, update)
        assert await _enforced(two, sandbox_id) == NEW
    finally:
        await one.sandboxes.kill(await one.sandboxes.get(sandbox_id, owner=OWNER))


async def test_a_resume_that_gave_up_leaves_a_runner_the_next_resume_brings_in_line(
    workers: tuple[_Worker, _Worker],
) -> None:
    """Worker two's resume launches the sandbox with the old policy and is cancelled
    before its row write (its client went away): the runner stays up, the row says
    paused. Worker one's update then writes only the row, and one's resume reuses that
    live runner, which was not launched with the new spec: the resume must set it."""
    one, two = workers
    sandbox_id = await _paused_sandbox(one)
    try:
        gate = two.registry.hold(lambda row: row.state == "running")
        resume = asyncio.create_task(
            two.sandboxes.connect(await two.sandboxes.get(sandbox_id, owner=OWNER), timeout_s=None)
        )
        await _while_held(gate, resume)
        resume.cancel()
        with pytest.raises(asyncio.CancelledError):
            await resume

        updating = await one.sandboxes.get(sandbox_id, owner=OWNER)
        assert updating.state == "paused"
        await one.sandboxes.set_network(updating, NEW)
        await one.sandboxes.connect(updating, timeout_s=None)
        assert await _enforced(two, sandbox_id) == NEW
    finally:
        await one.sandboxes.kill(await one.sandboxes.get(sandbox_id, owner=OWNER))


async def test_an_update_whose_row_write_fails_leaves_the_runner_on_the_rows_policy(
    workers: tuple[_Worker, _Worker],
) -> None:
    """The update is applied to the running sandbox's runner first; its row write then
    fails (the registry is down): the update is an error, so the runner must go back to
    the policy the row still holds, the one a resume would launch with."""
    one, _ = workers
    sandbox_id = await _paused_sandbox(one)
    try:
        await one.sandboxes.connect(
            await one.sandboxes.get(sandbox_id, owner=OWNER), timeout_s=None
        )
        assert await _enforced(one, sandbox_id) == OLD
        one.registry.fail(lambda row: row.egress == NEW)
        with pytest.raises(RegistryError):
            await one.sandboxes.set_network(await one.sandboxes.get(sandbox_id, owner=OWNER), NEW)
        assert await _enforced(one, sandbox_id) == OLD

        # And an update that lands afterwards is enforced as before.
        await one.sandboxes.set_network(await one.sandboxes.get(sandbox_id, owner=OWNER), NEWER)
        assert await _enforced(one, sandbox_id) == NEWER
    finally:
        await one.sandboxes.kill(await one.sandboxes.get(sandbox_id, owner=OWNER))
