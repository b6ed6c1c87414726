"""The app API's failures say what failed, never where: a template that cannot be
cloned, or a dev server the runner cannot get an answer from, is a 500 ``internal``
that names no runner route, address or host path; what the failure itself said is
in the service's log (WARNING) instead.

Through ``sandcell serve``'s app under a real uvicorn, real runners and git underneath.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sandcell_protocol import ErrorBody, ErrorCode, decode, routes
from tests.fixtures.killed_runner import assert_no_internal_detail
from tests.fixtures.runner_process import free_port

from .conftest import StartApi

# Accepts connections (the kernel queues them) and never answers one: the runner's
# proxy waits, so the orchestrator's probe times out on the runner's own route.
_SILENT_SERVER = """\
import os, socket, time
server = socket.socket()
server.bind(("0.0.0.0", int(os.environ["PORT"])))
server.listen()
print("listening, answering nothing", flush=True)
time.sleep(600)
"""
_SILENT_MANIFEST = """\
preview_port = 8000
[start]
command = "exec python3 -u silent.py"
[ready]
timeout_s = 5
"""
# 5 s, not 1: the app must be listening before the deadline (a python3 start on a
# loaded machine can take over a second), or the last probe is the runner's own 502
# rather than the timeout on its route that this test is about. A probe of the
# silent server itself waits its own 5 s, so the answer comes in 5-10 s.


def _silent_template(root: Path) -> Path:
    root.mkdir()
    (root / "sandcell-template.toml").write_text(_SILENT_MANIFEST)
    (root / "silent.py").write_text(_SILENT_SERVER)
    return root


def _error(text: bytes) -> tuple[ErrorCode, str]:
    error = decode(text, ErrorBody).error
    return error.code, error.message


async def test_a_dev_server_that_never_answers_is_told_without_the_runner_route(
    start_api: StartApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The ready probe's timeout named the runner's port route; the caller gets which
    step failed and the app's own output, the log gets the route."""
    caplog.set_level(logging.INFO, logger="sandcell_orchestrator.serve.errors")
    api = await start_api(templates={"silent": str(_silent_template(tmp_path / "silent"))})
    response = await api.client.post(
        "/v1/instances", json={"template": "silent", "project_name": "demo"}, headers=api.auth()
    )
    assert response.status_code == 500, response.text
    code, message = _error(response.content)
    assert code is ErrorCode.INTERNAL
    assert message.startswith("the app did not start: the dev server was not ready in 5s")
    assert "listening, answering nothing" in message  # the app's output is the caller's
    assert_no_internal_detail(response.text, runtime_dir=api.runtime_dir)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert routes.SESSION_PORTS_PREFIX in record.getMessage()


async def test_a_template_that_cannot_be_cloned_names_no_url(
    start_api: StartApi, caplog: pytest.LogCaptureFixture
) -> None:
    """git's own words name the configured source (its URL, its address); only the log
    may. Nothing listens on the loopback port, so the clone fails at once."""
    caplog.set_level(logging.INFO, logger="sandcell_orchestrator.serve.errors")
    api = await start_api(templates={"gone": f"git+http://127.0.0.1:{free_port()}/operator-only"})
    response = await api.client.post(
        "/v1/instances", json={"template": "gone", "project_name": "demo"}, headers=api.auth()
    )
    assert response.status_code == 500, response.text
    assert _error(response.content) == (ErrorCode.INTERNAL, "the template could not be loaded")
    assert "operator-only" not in response.text
    assert_no_internal_detail(response.text, runtime_dir=api.runtime_dir)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "operator-only" in record.getMessage()


async def test_an_unknown_template_is_a_400_naming_the_configured_ones(
    start_api: StartApi, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller's own mistake: its words and the names it may use, logged at INFO."""
    caplog.set_level(logging.INFO, logger="sandcell_orchestrator.serve.errors")
    api = await start_api()
    response = await api.client.post(
        "/v1/instances", json={"template": "nope", "project_name": "demo"}, headers=api.auth()
    )
    assert response.status_code == 400, response.text
    assert _error(response.content) == (
        ErrorCode.BAD_REQUEST,
        "no such template: 'nope' (configured: python-web, static-site)",
    )
    assert [r.levelno for r in caplog.records] == [logging.INFO]
