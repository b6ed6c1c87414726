"""A run that fails after its outputs were kept, before its turn committed, leaves none
of them behind: ``collect`` stores them while the turn holds its sandbox (the commit's
answer names them), so a turn whose commit cannot be written must remove them again.

LibreChat's own client runs a job in a runtime session of a ``sandcell serve`` whose
registry is a private Redis; once the job runs, that Redis is killed, so the job ends,
its output is kept, and the turn's commit fails. The error answer names no file, and
the store holds none of the run's.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.fixtures.private_redis import PrivateRedis, private_redis_server

from .conftest import KEY_A, Driver, Serve, node_driver, running_serve

_WAIT_S = 120.0
"""A bound on waiting for the job to start (a loaded machine is slow), not a timing."""


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[PrivateRedis]:
    with private_redis_server(tmp_path) as server:
        yield server


@pytest.fixture
def serve(registry: PrivateRedis) -> Iterator[Serve]:
    with running_serve("lc-failed-", SANDCELL_REGISTRY_URL=registry.url) as running:
        yield running


@pytest.fixture
def driver(serve: Serve) -> Iterator[Driver]:
    with node_driver(serve) as running:
        yield running


def _job(content: str, marker: str) -> str:
    """Python that writes its output, then runs a child named by ``marker`` until the
    test ends it: the window in which the test takes the registry away, however
    slowly the machine runs."""
    return (
        "import subprocess, sys\n"
        f"open('/mnt/data/kept.txt', 'w').write({content!r})\n"
        f"subprocess.run([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\n"
    )


def _job_without_wait(content: str) -> str:
    return f"open('/mnt/data/kept.txt', 'w').write({content!r})\n"


def _wait_for(marker: str) -> psutil.Process:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if marker in process.cmdline():
                    return process
        time.sleep(0.05)
    raise AssertionError(f"the job {marker} never started")


def _stored_with(root: Path, content: str) -> list[Path]:
    """The objects under ``root`` (the serve's input store) whose bytes are ``content``."""
    wanted = content.encode()
    return [path for path in root.rglob("*") if path.is_file() and path.read_bytes() == wanted]


def test_outputs_kept_before_a_failed_commit_are_removed(
    serve: Serve, driver: Driver, registry: PrivateRedis
) -> None:
    content = f"kept-output-{uuid.uuid4().hex}"
    marker = f"sandcell-failed-commit-{uuid.uuid4().hex[:12]}"
    params = {
        "baseUrl": serve.base,
        "authHeaders": {"X-API-Key": KEY_A},
        "user_id": "user-1",
        "statefulSessions": True,
        "executionProfile": "stateful",
        "runtimeSessionHint": f"conv-{uuid.uuid4().hex[:8]}",
    }
    answer: list[Any] = []
    thread = threading.Thread(
        target=lambda: answer.append(
            driver.invoke(params=params, args={"lang": "py", "code": _job(content, marker)})
        )
    )
    # The control: the same outputs, kept, where the run commits.
    control = f"kept-output-{uuid.uuid4().hex}"
    done = driver.invoke(params=params, args={"lang": "py", "code": _job_without_wait(control)})
    assert done["ok"], done
    assert len(_stored_with(serve.home / "inputs", control)) == 1
    thread.start()
    try:
        sleeper = _wait_for(marker)
        registry.stop()
        sleeper.terminate()  # the job goes on, to a commit that cannot be written
    finally:
        thread.join(timeout=300)
    assert answer, "the run never answered"
    (result,) = answer
    assert not result["ok"], result
    assert "kept.txt" not in str(result)
    assert _stored_with(serve.home / "inputs", content) == []
