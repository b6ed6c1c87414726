"""Entry points: the documented `sandcell exec` demo on the emulator's CLI, the public API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import sandcell_orchestrator.emulator as emulator_package
from sandcell_orchestrator.bootstrap import open_provider
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.providers import (
    lambda_auth,
    lambda_client,
    lambda_microvm,
    lambda_settings,
    ratelimit,
)
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_protocol import ExecuteRequest
from tests.fixtures.runner_process import free_port


@pytest.fixture
def emulator_process(vm_base: Path) -> Iterator[str]:
    """``python -m sandcell_orchestrator.emulator --port N``, stopped by its pid."""
    port = free_port()
    log_path = vm_base / "emulator.log"
    argv = [sys.executable, "-m", "sandcell_orchestrator.emulator", "--port", str(port)]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [*argv, "--base-dir", str(vm_base / "vms"), "--log-level", "warning"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{url}/_emulator/vms", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the emulator did not start"
            time.sleep(0.1)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def test_sandcell_exec_on_microvms_as_documented(emulator_process: str, tmp_path: Path) -> None:
    """docs/aws-lambda-microvm.md: two CLI calls, one session, state carried by checkpoint."""
    env = {
        **os.environ,
        "SANDCELL_HOME": str(tmp_path / "home"),
        "SANDCELL_PROVIDER": "lambda-microvm",
        "SANDCELL_MICROVM_IMAGE": "sandcell-runner",
        "SANDCELL_MICROVM_ENDPOINT_URL": emulator_process,
        "SANDCELL_MICROVM_REGION": "us-east-1",
        "SANDCELL_MICROVM_POLL_INTERVAL_S": "0.1",
        "AWS_ACCESS_KEY_ID": "emulator",
        "AWS_SECRET_ACCESS_KEY": "emulator",
    }
    cli = [sys.executable, "-m", "sandcell_orchestrator", "exec", "--session", "demo"]
    first = subprocess.run(
        [*cli, "open('n.txt', 'w').write('7'); print(6*7)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "42"
    second = subprocess.run(
        [*cli, "print(open('n.txt').read())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "7"
    vms = httpx.get(f"{emulator_process}/_emulator/vms", timeout=5).json()
    assert [vm["state"] for vm in vms] == ["TERMINATED", "TERMINATED"]


async def test_bootstrap_builds_the_provider_from_the_environment(
    emulator_url: str, tmp_path: Path
) -> None:
    """SANDCELL_PROVIDER=lambda-microvm: configuration, not code, picks the backend."""
    env = {
        "SANDCELL_HOME": str(tmp_path),
        "SANDCELL_PROVIDER": "lambda-microvm",
        "SANDCELL_MICROVM_IMAGE": "sandcell-runner",
        "SANDCELL_MICROVM_ENDPOINT_URL": emulator_url,
        "SANDCELL_MICROVM_REGION": "us-east-1",
    }
    provider = open_provider(OrchestratorSettings.from_env(env).provider)
    try:
        assert isinstance(provider, lambda_microvm.LambdaMicrovmProvider)
        assert provider.settings.endpoint_url == emulator_url
    finally:
        await provider.close()


async def test_the_microvms_runner_is_read_up_to_the_configured_ceiling(
    emulator_url: str, tmp_path: Path
) -> None:
    """``SANDCELL_ANSWER_*`` reaches the clients of the runners in the VMs (the tenant's
    side), through ``open_provider`` as ``open_services`` calls it."""
    settings = OrchestratorSettings.from_env(
        {
            "SANDCELL_HOME": str(tmp_path),
            "SANDCELL_PROVIDER": "lambda-microvm",
            "SANDCELL_MICROVM_IMAGE": "sandcell-runner",
            "SANDCELL_MICROVM_ENDPOINT_URL": emulator_url,
            "SANDCELL_MICROVM_REGION": "us-east-1",
            "SANDCELL_ANSWER_MAX_OUTPUT_BYTES": str(128 << 20),
        }
    )
    assert settings.answer_caps.max_stdout_bytes == 128 << 20
    provider = open_provider(settings.provider, answer_caps=settings.answer_caps)
    try:
        handle = await provider.create(SandboxSpec())
        try:
            assert handle.runner.connection.ceiling == settings.answer_caps
            done = await handle.runner.execute(ExecuteRequest(language="bash", code="echo up"))
            assert done.stdout == "up\n", done.stderr
        finally:
            await handle.close()
            await provider.destroy(handle.sandbox_id)
    finally:
        await provider.close()


@pytest.mark.parametrize(
    ("module", "names"),
    [
        (lambda_microvm, ["PROVIDER_NAME", "LambdaMicrovmProvider", "MicrovmMetrics"]),
        (lambda_settings, ["ENV", "MAX_TOKEN_MINUTES", "LambdaMicrovmSettings"]),
        (lambda_client, ["ConflictError", "MicrovmApi", "VmStatus", "make_client"]),
        (
            lambda_auth,
            [
                "DEFAULT_PROXY_PORT",
                "PROXY_PORT_HEADER",
                "MicrovmProxyAuth",
                "ProxyToken",
                "ProxyTokenCache",
                "SecretLogFilter",
                "decode_run_hook_payload",
                "derive_runner_token",
                "encode_run_hook_payload",
                "install_log_redaction",
            ],
        ),
        (
            ratelimit,
            ["RATE_LIMIT_LUA", "InProcessRateLimiter", "RateLimiter", "RedisRateLimiter"],
        ),
        (
            emulator_package,
            [
                "EmulatedVm",
                "EmulatorClock",
                "Faults",
                "MicrovmEmulator",
                "RecordedCall",
                "VmState",
                "serve_in_thread",
            ],
        ),
    ],
)
def test_public_api_is_pinned(module: object, names: list[str]) -> None:
    """What each module exports is a decision, not an accident."""
    exported = module.__all__  # type: ignore[attr-defined]
    assert sorted(exported) == sorted(names)
    for name in exported:
        assert hasattr(module, name)


def test_the_emulator_removes_its_own_temp_dir_on_sigterm(tmp_path: Path) -> None:
    """Without --base-dir the emulator makes sandcell-microvms-* under $TMPDIR and
    removes it when stopped by SIGTERM; the poll default against it is 0.1 s."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "sandcell_orchestrator.emulator", "--port", str(port)],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("sandcell-microvms-*")) or not _answers(port):
            assert process.poll() is None
            assert time.monotonic() < deadline, "the emulator did not start"
            time.sleep(0.1)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    assert list(tmp_path.glob("sandcell-microvms-*")) == []
    local = {"SANDCELL_MICROVM_IMAGE": "img", "SANDCELL_MICROVM_REGION": "us-east-1"}
    near = OrchestratorSettings.from_env(
        {
            **local,
            "SANDCELL_PROVIDER": "lambda-microvm",
            "SANDCELL_MICROVM_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
    )
    far = OrchestratorSettings.from_env({**local, "SANDCELL_PROVIDER": "lambda-microvm"})
    assert getattr(near.provider, "poll_interval_s", None) == 0.1
    assert getattr(far.provider, "poll_interval_s", None) == 1.0


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/_emulator/vms", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
