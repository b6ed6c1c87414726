"""scripts/create-microvm-image against the emulator, through real boto3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandcell_orchestrator.emulator import Faults, MicrovmEmulator
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.base import SandboxSpec

from .conftest import ProviderFactory

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "create-microvm-image"


def run_script(emulator_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        str(SCRIPT),
        "--name",
        "sandcell-runner",
        "--base-image-arn",
        "arn:aws:lambda:us-east-1:aws:microvm-image:al2023-1",
        "--build-role-arn",
        "arn:aws:iam::123456789012:role/sandcell-microvm-build",
        "--code-uri",
        "s3://artifacts/sandcell-runner.zip",
        "--region",
        "us-east-1",
        "--endpoint-url",
        emulator_url,
        "--poll-interval-s",
        "0.1",
        *extra,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


async def test_builds_an_image_the_provider_then_runs(
    emulator: MicrovmEmulator,
    emulator_url: str,
    provider_factory: ProviderFactory,
    handles: list[SandboxHandle],
) -> None:
    """ALL capabilities, the run hook, the merged environment; a VM from it warms up."""
    done = run_script(
        emulator_url, "--env-json", '{"SANDCELL_RUNNER_WARMUP_COMMAND": "true", "EXTRA": "1"}'
    )
    assert done.returncode == 0, done.stderr
    built = json.loads(done.stdout)
    image = emulator.images.get(built["imageArn"])
    request = image.request
    assert request["additionalOsCapabilities"] == ["ALL"]
    assert request["hooks"]["microvmHooks"]["run"] == "ENABLED"
    env = request["environmentVariables"]
    assert env["SANDCELL_RUNNER_SESSIONS"] == "1"
    assert env["SANDCELL_RUNNER_WARMUP_COMMAND"] == "true"
    assert env["EXTRA"] == "1"
    assert "SANDCELL_RUNNER_TOKEN" not in env

    provider = provider_factory(image=built["imageArn"], image_version=built["imageVersion"])
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    health = await handle.runner.health()
    assert health.warmup in ("running", "done")


def test_a_failed_build_exits_non_zero(emulator_url: str, faults: Faults) -> None:
    faults.image_build_fails = True
    done = run_script(emulator_url)
    assert done.returncode == 1
    assert "build failed" in done.stderr
    assert done.stdout == ""


def test_the_deadline_bounds_the_wait(emulator: MicrovmEmulator, emulator_url: str) -> None:
    emulator.images.build_s = 600
    done = run_script(emulator_url, "--deadline-minutes", "0.01")
    assert done.returncode == 3
    assert "deadline" in done.stderr


@pytest.mark.parametrize(
    "env_json",
    ['{"SANDCELL_RUNNER_TOKEN": "baked-secret-0123456789"}', "[1, 2]", "{not json"],
)
def test_refuses_a_secret_or_malformed_environment(emulator_url: str, env_json: str) -> None:
    done = run_script(emulator_url, "--env-json", env_json)
    assert done.returncode == 2
    assert "baked-secret" not in done.stderr
