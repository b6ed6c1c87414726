"""E2B's SDKs against two ``sandcell serve`` workers on one redis-server and one S3
(moto's server), as docs/deployment.md deploys them (issue 20): a sandbox created
through one worker is used through the other (commands, files, the code
interpreter, list, connect, timeout, pause, kill), a create retried with its
``Idempotency-Key`` on the other worker answers the first create's sandbox, and so
does a keyed cell (``/execute``) with the first run's answer.

The workers share ``SANDCELL_LOCAL_RUNTIME_DIR`` (workers on one host may), so each
reaches the sandboxes the other launched, through the session record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from e2b import ALL_TRAFFIC, NotFoundException, Sandbox, SandboxState
from e2b_code_interpreter import Sandbox as CodeSandbox

from tests.e2b_api.conftest import KEY_B, E2bServe, start_serve, stop_serve
from tests.e2b_api.test_execute_once import execute, runs, stdout_of
from tests.e2b_api.test_sdk_egress import ALLOWED, probe
from tests.fixtures.egress_remote import RemoteNetwork
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers
from tests.orchestrator.conftest import redis_url, running_s3
from tests.orchestrator.serve.fleet import fleet_env

__all__ = ["redis_url"]


@pytest.fixture(scope="module")
def fleet(redis_url: str) -> Iterator[tuple[E2bServe, E2bServe, RemoteNetwork]]:
    with running_s3() as s3, traversable_dir("e2b-fleet-") as base:
        remote = RemoteNetwork(base)
        try:
            env = {
                **fleet_env(redis_url, s3, prefix="e2b"),
                # The test's own namespace as the runners' allowed network and resolver.
                "SANDCELL_RUNNER_EGRESS_DNS": remote.address,
                "SANDCELL_RUNNER_EGRESS_ALLOW_NETS": remote.network,
            }
            shared = base / "sandboxes"
            one = start_serve(base / "w1", env=env, runtime_dir=shared)
            try:
                two = start_serve(base / "w2", env=env, runtime_dir=shared)
                try:
                    yield one, two, remote
                finally:
                    stop_serve(two)
            finally:
                stop_serve(one)
                # With a shared registry sandboxes outlive a worker by design: the test
                # killed its own above, so none may be left.
                leftovers = stop_leftovers(shared)
                assert not leftovers, f"sandbox processes left behind: {leftovers}"
        finally:
            remote.close()


@pytest.fixture
def workers(fleet: tuple[E2bServe, E2bServe, RemoteNetwork]) -> tuple[E2bServe, E2bServe]:
    return fleet[0], fleet[1]


def test_a_sandbox_made_on_one_worker_is_used_through_the_other(
    workers: tuple[E2bServe, E2bServe],
) -> None:
    """Commands, files, list, info and timeout through worker two; kill through it ends
    the sandbox on worker one too."""
    one, two = workers
    made = Sandbox.create(metadata={"who": "fleet"}, **one.opts())
    try:
        made.files.write("from-one.txt", "written through worker one")
        there = Sandbox.connect(made.sandbox_id, **two.opts())
        assert there.files.read("from-one.txt") == "written through worker one"
        assert there.commands.run("echo $((6 * 7))").stdout == "42\n"
        there.files.write("from-two.txt", "written through worker two")
        assert made.files.read("from-two.txt") == "written through worker two"
        assert made.commands.run("cat from-two.txt").stdout == "written through worker two"

        listed = {s.sandbox_id: s for s in Sandbox.list(**two.opts()).next_items()}
        assert listed[made.sandbox_id].metadata == {"who": "fleet"}
        before = Sandbox.get_info(made.sandbox_id, **one.opts()).end_at
        Sandbox.set_timeout(made.sandbox_id, 3600, **two.opts())
        after = Sandbox.get_info(made.sandbox_id, **one.opts()).end_at
        assert after > before

        # Another tenant sees nothing of it on either worker.
        with pytest.raises(NotFoundException):
            Sandbox.get_info(made.sandbox_id, **two.opts(KEY_B))
        assert made.sandbox_id not in {
            s.sandbox_id for s in Sandbox.list(**one.opts(KEY_B)).next_items()
        }
    finally:
        assert Sandbox.kill(made.sandbox_id, **two.opts()) is True
    with pytest.raises(NotFoundException):
        Sandbox.get_info(made.sandbox_id, **one.opts())
    assert made.sandbox_id not in {s.sandbox_id for s in Sandbox.list(**one.opts()).next_items()}
    assert made.is_running() is False


def test_the_code_interpreter_through_the_other_worker(
    workers: tuple[E2bServe, E2bServe],
) -> None:
    """One interpreter: a variable set through worker one is read through worker two."""
    one, two = workers
    made = CodeSandbox.create(**one.opts())
    try:
        assert made.run_code("x = 41").error is None
        there = CodeSandbox.connect(made.sandbox_id, **two.opts())
        assert there.run_code("x + 1").text == "42"
    finally:
        made.kill()


def test_a_keyed_cell_retried_on_the_other_worker_runs_once(
    workers: tuple[E2bServe, E2bServe],
) -> None:
    """``/execute`` with an ``Idempotency-Key`` through worker one, retried through worker
    two: the first run's NDJSON byte for byte (its uuid), and the counter the cell bumps
    in the interpreter is 1."""
    one, two = workers
    made = CodeSandbox.create(**one.opts())
    try:
        assert made.run_code("runs = 0").error is None
        first = execute(one, made, key="fleet-cell-1")
        assert first.status_code == 200, first.text
        again = execute(two, made, key="fleet-cell-1")
        assert again.status_code == 200, again.text
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
        assert len(stdout_of(first).strip()) == 36
        assert runs(CodeSandbox.connect(made.sandbox_id, **two.opts())) == "1"
    finally:
        made.kill()


def test_paused_on_one_worker_resumed_on_the_other(workers: tuple[E2bServe, E2bServe]) -> None:
    """Pause through worker one saves the workspace; connect through worker two resumes
    it with its files; worker one then reaches the resumed sandbox, not the old one."""
    one, two = workers
    made = Sandbox.create(**one.opts())
    try:
        made.files.write("keep.txt", "kept across workers")
        assert made.pause() is True
        info = Sandbox.get_info(made.sandbox_id, **two.opts())
        assert info.state == SandboxState.PAUSED
        resumed = Sandbox.connect(made.sandbox_id, **two.opts())
        assert resumed.files.read("keep.txt") == "kept across workers"
        back = Sandbox.connect(made.sandbox_id, **one.opts())
        assert back.commands.run("cat keep.txt").stdout == "kept across workers"
        assert Sandbox.get_info(made.sandbox_id, **one.opts()).state == SandboxState.RUNNING
    finally:
        Sandbox.kill(made.sandbox_id, **one.opts())


def test_a_network_update_on_one_worker_holds_when_the_other_resumes(
    fleet: tuple[E2bServe, E2bServe, RemoteNetwork],
) -> None:
    """Worker two has seen the sandbox before worker one replaces its egress policy and
    pauses it: two's resume launches it with the new policy, not the one it had seen."""
    one, two, remote = fleet
    made = Sandbox.create(allow_internet_access=False, **one.opts())
    try:
        assert Sandbox.get_info(made.sandbox_id, **two.opts()).state == SandboxState.RUNNING
        made.update_network({"allow_out": [ALLOWED], "deny_out": [ALL_TRAFFIC]})
        assert made.pause() is True
        resumed = Sandbox.connect(made.sandbox_id, **two.opts())
        assert probe(resumed, remote) == ["200/200", "000/403"]
    finally:
        Sandbox.kill(made.sandbox_id, **one.opts())


def test_a_retried_create_on_the_other_worker_gets_the_first_sandbox(
    workers: tuple[E2bServe, E2bServe],
) -> None:
    """The Idempotency-Key is claimed in the registry: worker two answers worker one's
    sandbox, and the tenant has exactly one."""
    one, two = workers
    first = Sandbox.create(idempotency_key="fleet-retry-1", **one.opts(KEY_B))
    try:
        again = Sandbox.create(idempotency_key="fleet-retry-1", **two.opts(KEY_B))
        assert again.sandbox_id == first.sandbox_id
        assert again.commands.run("echo once").stdout == "once\n"
        mine = [s.sandbox_id for s in Sandbox.list(**two.opts(KEY_B)).next_items()]
        assert mine == [first.sandbox_id]
    finally:
        first.kill()
    # Once it is killed, the key makes one new sandbox (once), on either worker.
    fresh = Sandbox.create(idempotency_key="fleet-retry-1", **two.opts(KEY_B))
    try:
        assert fresh.sandbox_id != first.sandbox_id
        same = Sandbox.create(idempotency_key="fleet-retry-1", **one.opts(KEY_B))
        assert same.sandbox_id == fresh.sandbox_id
    finally:
        fresh.kill()


def test_a_timeout_is_enforced_by_the_fleet(workers: tuple[E2bServe, E2bServe]) -> None:
    """A timeout set through one worker ends the sandbox for both (every worker sweeps
    the shared table; the one that acts first removes the row)."""
    one, two = workers
    made = Sandbox.create(timeout=300, **one.opts())
    Sandbox.set_timeout(made.sandbox_id, 1, **two.opts())

    def gone() -> bool:
        try:
            Sandbox.get_info(made.sandbox_id, **one.opts())
        except NotFoundException:
            return True
        return False

    _until(gone)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(made.sandbox_id, **two.opts())


def _until(condition: Callable[[], bool], attempts: int = 300) -> None:
    for _ in range(attempts):
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")
