"""A runner states the limits that bound its answers; the client's caps follow them.

Real runner processes over HTTP with non-default ``SANDCELL_RUNNER_*`` limits: the
authenticated ``Health`` carries them (to a peer of protocol 1.3 or later, never to
an older one, which decodes ``Health`` strictly), and the ``RunnerClient`` reads
answers by caps that follow them, never above the caps it was built with (its
ceiling: a taken-over runner can state anything). A runner of the previous minor,
started from this repository's own history, states nothing and is read by the
ceiling, as before.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.errors import (
    AnswerCeilingError,
    RunnerAnswerError,
    RunnerRequestError,
)
from sandcell_orchestrator.runner.answers import DEFAULT_CAPS, AnswerCaps, PastCeiling
from sandcell_orchestrator.runner.client import RunnerClient
from sandcell_orchestrator.runner.transfers import InputPayload
from sandcell_protocol import (
    LIMITS_SINCE,
    ExecuteRequest,
    FileRef,
    RunnerLimits,
    RunStatus,
    headers,
    input_cache_key,
    runtime_session_id,
)
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, start_runner, tree_python

from .conftest import StartRunner

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[3]
VERSION_FILE = "packages/protocol/src/sandcell_protocol/version.py"

SMALL = {
    "SANDCELL_RUNNER_TIMEOUT_MS": "20000",
    "SANDCELL_RUNNER_MAX_TIMEOUT_MS": "40000",
    "SANDCELL_RUNNER_STDOUT_BYTES": str(256 << 10),
    "SANDCELL_RUNNER_MAX_STDOUT_BYTES": str(2 * MIB),
    "SANDCELL_RUNNER_STDERR_BYTES": str(128 << 10),
    "SANDCELL_RUNNER_MAX_STDERR_BYTES": str(1 * MIB),
    "SANDCELL_RUNNER_MAX_BODY_BYTES": str(8 * MIB),
    "SANDCELL_RUNNER_OUTPUT_INLINE_BYTES": str(64 << 10),
    "SANDCELL_RUNNER_MAX_OUTPUT_FILES": "10",
    "SANDCELL_RUNNER_OUTPUT_SCAN_BYTES": str(4 * MIB),
    "SANDCELL_CHECKPOINT_MAX_BYTES": str(32 * MIB),
    "SANDCELL_INPUT_MAX_OBJECT_BYTES": str(16 * MIB),
}


def _health_json(runner: RunnerProcess, protocol: str | None) -> dict[str, object]:
    """The authenticated ``/health`` as a peer announcing ``protocol`` (None: no header)."""
    announced = {} if protocol is None else {headers.PROTOCOL: protocol}
    answer = httpx.get(runner.url + "/health", headers=runner.headers(**announced))
    assert answer.status_code == 200, answer.text
    found: dict[str, object] = answer.json()
    return found


async def test_a_runner_states_its_limits_and_the_caps_follow_them_down(
    runner_factory: StartRunner,
) -> None:
    """Limits below the defaults: stated as configured, and every runner-side cap
    follows (a smaller execute answer, file read, and run time budget)."""
    runner = runner_factory(**SMALL)
    async with RunnerClient(runner.url, token=runner.token) as client:
        health = await client.health()
        assert health.limits == RunnerLimits(
            timeout_ms=20_000,
            max_timeout_ms=40_000,
            stdout_bytes=256 << 10,
            max_stdout_bytes=2 * MIB,
            stderr_bytes=128 << 10,
            max_stderr_bytes=1 * MIB,
            max_body_bytes=8 * MIB,
            output_inline_bytes=64 << 10,
            max_output_files=10,
            output_scan_bytes=4 * MIB,
            checkpoint_max_bytes=32 * MIB,
            input_max_object_bytes=16 * MIB,
        )
        caps = client.connection.caps
        assert client.connection.ceiling == DEFAULT_CAPS
        assert (caps.stdout_bytes, caps.max_stdout_bytes) == (256 << 10, 2 * MIB)
        assert (caps.stderr_bytes, caps.max_stderr_bytes) == (128 << 10, 1 * MIB)
        assert (caps.max_body_bytes, caps.max_output_files) == (8 * MIB, 10)
        assert (caps.output_scan_bytes, caps.max_timeout_ms) == (4 * MIB, 40_000)
        # What the runner does not state stays the client's own.
        assert (caps.answer_bytes, caps.error_bytes) == (
            DEFAULT_CAPS.answer_bytes,
            DEFAULT_CAPS.error_bytes,
        )
        assert caps.execute_bytes() < DEFAULT_CAPS.execute_bytes() // 10
        done = await client.execute(ExecuteRequest(language="python", code="print(6 * 7)"))
        assert (done.status, done.stdout) == (RunStatus.OK, "42\n")


async def test_stated_limits_never_raise_the_caps_past_the_clients_ceiling(
    runner_factory: StartRunner,
) -> None:
    """A runner stating more than the ceiling is read by the ceiling; a lower ceiling
    than the runner's defaults wins over them."""
    runner = runner_factory(
        SANDCELL_RUNNER_STDOUT_BYTES=str(96 * MIB),
        SANDCELL_RUNNER_MAX_STDOUT_BYTES=str(128 * MIB),
        SANDCELL_RUNNER_MAX_BODY_BYTES=str(256 * MIB),
    )
    async with RunnerClient(runner.url, token=runner.token) as client:
        health = await client.health()
        assert health.limits is not None
        assert health.limits.max_stdout_bytes == 128 * MIB
        caps = client.connection.caps
        assert (caps.stdout_bytes, caps.max_stdout_bytes) == (64 * MIB, 64 * MIB)
        assert caps.max_body_bytes == DEFAULT_CAPS.max_body_bytes
    ceiling = AnswerCaps(max_body_bytes=1 * MIB, max_output_files=5)
    async with RunnerClient(runner.url, token=runner.token, caps=ceiling) as client:
        await client.health()
        assert (client.connection.caps.max_body_bytes, client.connection.caps.max_output_files) == (
            1 * MIB,
            5,
        )


TIGHT = AnswerCaps(
    stdout_bytes=64 << 10,
    stderr_bytes=64 << 10,
    max_stdout_bytes=8 * MIB,
    max_stderr_bytes=8 * MIB,
    output_scan_bytes=0,
    max_output_files=0,
)
"""A ceiling that assumes 64 KiB of output when a request sets no limit."""


async def test_a_runner_configured_above_the_assumed_default_is_read_in_full(
    runner_factory: StartRunner,
) -> None:
    """A runner keeping 2 MiB of stdout by default (its ``SANDCELL_RUNNER_STDOUT_BYTES``)
    answers a request that sets no limit with 1.5 MiB: read in full, where caps fixed at
    the assumed default refused the answer as too large."""
    runner = runner_factory(SANDCELL_RUNNER_STDOUT_BYTES=str(2 * MIB))
    code = "import sys; sys.stdout.write('x' * (3 << 19))"
    async with RunnerClient(runner.url, token=runner.token, caps=TIGHT) as client:
        done = await client.execute(ExecuteRequest(language="python", code=code))
        assert (done.status, len(done.stdout), done.stdout_truncated) == (
            RunStatus.OK,
            3 << 19,
            False,
        )
        assert client.connection.caps.stdout_bytes == 2 * MIB


async def test_a_ceiling_below_the_stated_limits_names_both_variables(
    runner_factory: StartRunner,
) -> None:
    """The operator's ceiling (``SANDCELL_ANSWER_*``, read by the orchestrator's settings)
    under a runner's raised limits: what fits is read; a file past it is an
    ``AnswerCeilingError`` naming the runner's variable and the one to raise; a run's
    answer past its cap names the output variables, not the file one."""
    runner = runner_factory(
        SANDCELL_RUNNER_MAX_BODY_BYTES=str(4 * MIB),
        SANDCELL_RUNNER_STDOUT_BYTES=str(4 * MIB),
        SANDCELL_RUNNER_OUTPUT_SCAN_BYTES="0",
        SANDCELL_RUNNER_MAX_OUTPUT_FILES="0",
    )
    ceiling = OrchestratorSettings.from_env(
        {
            "HOME": "/nonexistent",
            "SANDCELL_ANSWER_MAX_BODY_BYTES": str(1 * MIB),
            "SANDCELL_ANSWER_MAX_OUTPUT_BYTES": str(256 << 10),
            "SANDCELL_ANSWER_OUTPUT_SCAN_BYTES": "0",
            "SANDCELL_ANSWER_MAX_OUTPUT_FILES": "0",
        }
    ).answer_caps
    session = runtime_session_id("tenant", "user", "ceiling")
    async with RunnerClient(runner.url, token=runner.token, caps=ceiling) as client:
        make = "open('big', 'wb').write(bytes(2 << 20)); open('small', 'wb').write(b'ok')"
        done = await client.execute(
            ExecuteRequest(language="python", code=make), session_id=session
        )
        assert done.status == RunStatus.OK
        assert client.connection.beyond == (
            PastCeiling(
                "SANDCELL_RUNNER_STDOUT_BYTES",
                4 * MIB,
                "SANDCELL_ANSWER_MAX_OUTPUT_BYTES",
                256 << 10,
            ),
            PastCeiling(
                "SANDCELL_RUNNER_STDERR_BYTES",
                1 * MIB,
                "SANDCELL_ANSWER_MAX_OUTPUT_BYTES",
                256 << 10,
            ),
            PastCeiling(
                "SANDCELL_RUNNER_MAX_STDOUT_BYTES",
                64 * MIB,
                "SANDCELL_ANSWER_MAX_OUTPUT_BYTES",
                256 << 10,
            ),
            PastCeiling(
                "SANDCELL_RUNNER_MAX_STDERR_BYTES",
                64 * MIB,
                "SANDCELL_ANSWER_MAX_OUTPUT_BYTES",
                256 << 10,
            ),
            PastCeiling(
                "SANDCELL_RUNNER_MAX_BODY_BYTES", 4 * MIB, "SANDCELL_ANSWER_MAX_BODY_BYTES", 1 * MIB
            ),
        )
        assert await client.read_file("small", session_id=session) == b"ok"
        with pytest.raises(AnswerCeilingError) as refused:
            await client.read_file("big", session_id=session)
        said = refused.value.public_detail or ""
        assert said.endswith(
            "(SANDCELL_RUNNER_MAX_BODY_BYTES=4194304 is above"
            " SANDCELL_ANSWER_MAX_BODY_BYTES=1048576): raise SANDCELL_ANSWER_MAX_BODY_BYTES,"
            " or lower the runner's limits"
        ), said
        assert not refused.value.retryable
        print_3_5mib = "import sys; sys.stdout.write('x' * (7 << 19))"
        with pytest.raises(AnswerCeilingError) as refused:
            await client.execute(ExecuteRequest(language="python", code=print_3_5mib))
        said = refused.value.public_detail or ""
        assert "raise SANDCELL_ANSWER_MAX_OUTPUT_BYTES," in said, said
        assert "MAX_BODY" not in said, said


async def test_inputs_past_the_stated_upload_cap_are_refused_before_sending(
    runner_factory: StartRunner,
) -> None:
    """``SANDCELL_INPUT_MAX_OBJECT_BYTES`` stated: a push past it is refused here, as the
    runner would refuse it, without sending (or hashing) its bytes; one within it goes."""
    runner = runner_factory(SANDCELL_INPUT_MAX_OBJECT_BYTES=str(1 * MIB))
    async with RunnerClient(runner.url, token=runner.token) as client:
        big = InputPayload(storage_session="s", object_id="big", data=bytes(1 * MIB + 1))
        with pytest.raises(RunnerRequestError) as refused:
            await client.push_inputs([big])
        assert refused.value.code == "payload_too_large"
        assert "refused before sending" in str(refused.value)
        small = InputPayload(storage_session="s", object_id="small", data=b"ok")
        assert await client.push_inputs([small]) == [input_cache_key("s", "small")]
        missing = FileRef(storage_session="s", object_id="big", name="big")
        assert await client.probe_inputs([missing]) == [missing]


def test_limits_go_only_to_a_peer_that_speaks_their_minor(runner_factory: StartRunner) -> None:
    """An older orchestrator (protocol 1.2) decodes ``Health`` strictly: it gets none."""
    runner = runner_factory(**SMALL)
    assert LIMITS_SINCE == "1.3"
    assert "limits" not in _health_json(runner, "1.2")
    assert "limits" not in _health_json(runner, None)
    stated = _health_json(runner, "1.3")["limits"]
    assert msgspec.convert(stated, RunnerLimits).max_output_files == 10


def _previous_minor() -> str:
    """The commit before the one that introduced protocol 1.3 (its parent: 1.2)."""
    found = subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "log",
            "--reverse",
            "--format=%H",
            "-S",
            'PROTOCOL_VERSION = "1.3"',
            "--",
            VERSION_FILE,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert found, "no commit introduced protocol 1.3 in this checkout's history"
    return f"{found[0]}^"


@pytest.fixture(scope="module")
def older_runner() -> Iterator[RunnerProcess]:
    """A runner of protocol 1.2: this repository's runner and protocol at the commit
    before 1.3, run from a tree of their own with this environment's dependencies."""
    with traversable_dir() as base:
        tree = base / "tree"
        archive = subprocess.run(
            [
                "git",
                "-C",
                str(ROOT),
                "archive",
                _previous_minor(),
                "packages/protocol",
                "packages/runner",
            ],
            capture_output=True,
            check=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        python = tree_python(tree, base / "venv")
        env = {"SANDCELL_RUNNER_STDOUT_BYTES": str(2 * MIB)}
        runner = start_runner(base / "root", python=python, env=env)
        try:
            yield runner
        finally:
            runner.stop()


async def test_an_older_runner_states_nothing_and_is_read_by_the_ceiling(
    older_runner: RunnerProcess,
) -> None:
    """A 1.2 runner (no ``limits``) still works with this client: same major, its
    answers read by the caps the client was built with (so a runner configured above
    them still has to be met by a client built with more, as before 1.3)."""
    async with RunnerClient(older_runner.url, token=older_runner.token) as client:
        health = await client.health()
        assert (health.protocol, health.limits) == ("1.2", msgspec.UNSET)
        assert client.connection.caps == DEFAULT_CAPS
        done = await client.execute(ExecuteRequest(language="python", code="print(6 * 7)"))
        assert (done.status, done.stdout) == (RunStatus.OK, "42\n")
    async with RunnerClient(older_runner.url, token=older_runner.token, caps=TIGHT) as client:
        code = "import sys; sys.stdout.write('x' * (3 << 19))"
        with pytest.raises(RunnerAnswerError, match="exceeds"):
            await client.execute(ExecuteRequest(language="python", code=code))
