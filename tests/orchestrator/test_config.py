"""One configuration object per process: everything read and validated at start-up."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.env import EnvReader
from sandcell_orchestrator.errors import ConfigError
from sandcell_orchestrator.providers.docker_settings import DockerSettings
from sandcell_orchestrator.providers.lambda_settings import LambdaMicrovmSettings
from sandcell_orchestrator.providers.local_settings import LocalSettings
from sandcell_orchestrator.runner.answers import DEFAULT_CAPS

HOME = {"SANDCELL_HOME": "/nonexistent/sandcell"}


def test_the_defaults_are_the_embedded_stack() -> None:
    settings = OrchestratorSettings.from_env(HOME)
    assert isinstance(settings.provider, LocalSettings)
    assert (settings.provider_name, settings.registry_url, settings.s3) == ("local", None, None)
    assert settings.snapshot_dir == Path("/nonexistent/sandcell/snapshots")


@pytest.mark.parametrize(
    "provider", [{}, {"SANDCELL_PROVIDER": "docker", "SANDCELL_DOCKER_IMAGE": "runner:1"}]
)
def test_what_runners_inherit_stays_out_of_the_repr(provider: dict[str, str]) -> None:
    """The variables passed through to every runner can hold credentials (a warmup
    command's index token, a local runner's file server user info): they reach the
    runner, not a repr."""
    secret = "inherit-S3CR3T-41d0"
    env = {
        **HOME,
        **provider,
        "SANDCELL_FILE_SERVER_URL": f"http://puller:{secret}@files.internal",
        "SANDCELL_RUNNER_WARMUP_COMMAND": f"pip download --index-url https://t:{secret}@pypi/",
    }
    settings = OrchestratorSettings.from_env(env)
    runner_env = settings.provider.runner_env  # type: ignore[union-attr]
    assert runner_env["SANDCELL_RUNNER_WARMUP_COMMAND"] == env["SANDCELL_RUNNER_WARMUP_COMMAND"]
    for text in (repr(settings), repr(settings.provider), str(settings)):
        assert secret not in text


@pytest.mark.parametrize(
    ("name", "settings_type", "extra"),
    [
        ("local", LocalSettings, {}),
        ("docker", DockerSettings, {}),
        ("lambda-microvm", LambdaMicrovmSettings, {"SANDCELL_MICROVM_IMAGE": "i"}),
    ],
)
def test_the_provider_is_a_union_tagged_by_kind(
    name: str, settings_type: type, extra: dict[str, str]
) -> None:
    settings = OrchestratorSettings.from_env({**HOME, "SANDCELL_PROVIDER": name, **extra})
    assert isinstance(settings.provider, settings_type)
    assert settings.provider.kind == name == settings.provider_name


def test_checkpoint_retry_budget_defaults_to_10_s_and_0_disables() -> None:
    assert OrchestratorSettings.from_env(HOME).checkpoint_retry_s == 10.0
    off = OrchestratorSettings.from_env({**HOME, "SANDCELL_CHECKPOINT_RETRY_S": "0"})
    assert off.checkpoint_retry_s == 0.0
    two = OrchestratorSettings.from_env({**HOME, "SANDCELL_CHECKPOINT_RETRY_S": "2.5"})
    assert two.checkpoint_retry_s == 2.5


def test_the_answer_ceiling_defaults_to_the_runners_default_maxima() -> None:
    """``SANDCELL_ANSWER_*``: unset, the caps every client was built with before; set,
    each its field (stdout and stderr alike), the rest untouched."""
    assert OrchestratorSettings.from_env(HOME).answer_caps == DEFAULT_CAPS
    raised = OrchestratorSettings.from_env(
        {
            **HOME,
            "SANDCELL_ANSWER_MAX_OUTPUT_BYTES": str(256 << 20),
            "SANDCELL_ANSWER_MAX_BODY_BYTES": str(1 << 30),
            "SANDCELL_ANSWER_OUTPUT_SCAN_BYTES": str(1 << 30),
            "SANDCELL_ANSWER_MAX_OUTPUT_FILES": "5000",
            "SANDCELL_ANSWER_MAX_TIMEOUT_MS": "3600000",
        }
    ).answer_caps
    assert raised == dataclasses.replace(
        DEFAULT_CAPS,
        max_stdout_bytes=256 << 20,
        max_stderr_bytes=256 << 20,
        max_body_bytes=1 << 30,
        output_scan_bytes=1 << 30,
        max_output_files=5000,
        max_timeout_ms=3_600_000,
    )
    low = OrchestratorSettings.from_env({**HOME, "SANDCELL_ANSWER_MAX_OUTPUT_BYTES": "4096"})
    assert (low.answer_caps.stdout_bytes, low.answer_caps.max_stderr_bytes) == (4096, 4096)
    # Not passed on to runners: the local provider passes SANDCELL_RUNNER_* only.
    local = OrchestratorSettings.from_env({**HOME, "SANDCELL_ANSWER_MAX_BODY_BYTES": "4096"})
    assert isinstance(local.provider, LocalSettings)
    assert not any("ANSWER" in name for name in local.provider.runner_env)


def test_no_raw_environment_is_kept() -> None:
    """Every field is typed configuration; nothing later parses the environment again."""
    settings = OrchestratorSettings.from_env({**HOME, "UNRELATED_SECRET": "s3cr3t-value"})
    names = {f.name for f in dataclasses.fields(settings)}
    assert "env" not in names
    assert "s3cr3t-value" not in repr(settings)


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SANDCELL_PROVIDER": "kubernetes"}, "SANDCELL_PROVIDER"),
        ({"SANDCELL_LOCAL_RUNTIME_DIR": "relative/dir"}, "SANDCELL_LOCAL_RUNTIME_DIR"),
        ({"SANDCELL_LOCAL_POOL_SIZE": "many"}, "SANDCELL_LOCAL_POOL_SIZE"),
        ({"SANDCELL_SERVE_PORT": "-1"}, "SANDCELL_SERVE_PORT"),
        ({"SANDCELL_CHECKPOINT_GRACE_S": "-5"}, "SANDCELL_CHECKPOINT_GRACE_S"),
        ({"SANDCELL_CHECKPOINT_RETRY_S": "-1"}, "SANDCELL_CHECKPOINT_RETRY_S"),
        ({"SANDCELL_PROVIDER": "docker", "DOCKER_HOST": "tcp://x:1"}, "DOCKER_HOST"),
        ({"SANDCELL_PROVIDER": "lambda-microvm"}, "SANDCELL_MICROVM_IMAGE"),
        (
            {"SANDCELL_SNAPSHOT_URL": "s3://snaps/p", "SANDCELL_S3_ENDPOINT": "ftp://x"},
            "SANDCELL_S3_ENDPOINT",
        ),
        ({"SANDCELL_APP_GIT_AUTHOR": "nobody"}, "SANDCELL_APP_GIT_AUTHOR"),
        ({"SANDCELL_API_KEYS": "short=ns"}, "SANDCELL_API_KEYS"),
        ({"SANDCELL_LOG_LEVEL": "verbose"}, "SANDCELL_LOG_LEVEL: must be one of critical"),
        ({"SANDCELL_ANSWER_MAX_OUTPUT_BYTES": "64MiB"}, "SANDCELL_ANSWER_MAX_OUTPUT_BYTES"),
        ({"SANDCELL_ANSWER_MAX_BODY_BYTES": "100"}, "SANDCELL_ANSWER_MAX_BODY_BYTES: must be >="),
        ({"SANDCELL_ANSWER_OUTPUT_SCAN_BYTES": "-1"}, "SANDCELL_ANSWER_OUTPUT_SCAN_BYTES"),
        ({"SANDCELL_ANSWER_MAX_OUTPUT_FILES": "many"}, "SANDCELL_ANSWER_MAX_OUTPUT_FILES"),
        ({"SANDCELL_ANSWER_MAX_TIMEOUT_MS": "10"}, "SANDCELL_ANSWER_MAX_TIMEOUT_MS: must be >="),
    ],
)
def test_a_bad_value_stops_start_up_naming_its_variable(env: dict[str, str], variable: str) -> None:
    """Sub-settings (provider, S3, apps, serve) are validated at start-up, not on first use."""
    with pytest.raises(ConfigError, match=variable):
        OrchestratorSettings.from_env({**HOME, **env})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SANDCELL_SERVE_PORT": "99999"}, "SANDCELL_SERVE_PORT: must be >= 0 and <= 65535"),
        ({"SANDCELL_SERVE_PORT": "80.5"}, "SANDCELL_SERVE_PORT: must be an integer"),
        ({"SANDCELL_E2B_MAX_SANDBOXES": "2.5"}, "SANDCELL_E2B_MAX_SANDBOXES: must be an integer"),
        ({"SANDCELL_E2B_MAX_SNAPSHOTS": "0"}, "SANDCELL_E2B_MAX_SNAPSHOTS: must be >= 1"),
        ({"SANDCELL_LOCAL_POOL_SIZE": "1.5"}, "SANDCELL_LOCAL_POOL_SIZE: must be an integer"),
        ({"SANDCELL_CHECKPOINT_MAX_BYTES": "-1"}, "SANDCELL_CHECKPOINT_MAX_BYTES: must be >= 1"),
        (
            {"SANDCELL_PROVIDER": "docker", "SANDCELL_DOCKER_PIDS": "64.5"},
            "SANDCELL_DOCKER_PIDS: must be an integer",
        ),
    ],
)
def test_counts_sizes_and_ports_are_whole_numbers_in_range(
    env: dict[str, str], message: str
) -> None:
    """A count, size or port is refused when fractional or out of range, not truncated
    (``80.5`` served on 80) or passed on to fail later (port 99999 at bind)."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        OrchestratorSettings.from_env({**HOME, **env})


def test_sub_settings_are_read_at_start_up() -> None:
    settings = OrchestratorSettings.from_env(
        {
            **HOME,
            "SANDCELL_SNAPSHOT_URL": "s3://snaps/prod",
            "SANDCELL_S3_ENDPOINT": "http://minio:9000",
            "SANDCELL_S3_ACCESS_KEY": "access",
            "SANDCELL_S3_SECRET_KEY": "secret-key-value",
            "SANDCELL_SERVE_HOST": "0.0.0.0",
            "SANDCELL_SERVE_PORT": "9100",
            "SANDCELL_LOCAL_POOL_SIZE": "2",
            "SANDCELL_RUNNER_MAX_JOBS": "3",
        }
    )
    assert settings.s3 is not None
    assert (settings.s3.endpoint, settings.s3.bucket, settings.s3.prefix) == (
        "minio:9000",
        "snaps",
        "prod",
    )
    assert "secret-key-value" not in repr(settings)
    assert (settings.serve.host, settings.serve.port) == ("0.0.0.0", 9100)
    assert settings.apps.public_url == "http://127.0.0.1:9100"
    assert isinstance(settings.provider, LocalSettings)
    assert settings.provider.pool_size == 2
    assert settings.provider.runner_env["SANDCELL_RUNNER_MAX_JOBS"] == "3"


def test_the_reader_names_the_variable_and_echoes_little() -> None:
    read = EnvReader({"N": "x" * 100, "F": "maybe", "BLANK": "  "})
    with pytest.raises(ConfigError, match=r"^N: must be a number, got 'x{40}'$"):
        read.number("N", 1.0)
    with pytest.raises(ConfigError, match=r"^F: must be 0 or 1"):
        read.flag("F")
    assert read.number("BLANK", 2.5) == 2.5
    assert "xxxx" not in repr(read)
