"""Fixtures: the MicroVM emulator under uvicorn on loopback, providers on real boto3.

Every VM the emulator launches is a real ``sandcell-runner`` process (real
nsjail), with its workspace root under a 0711 directory. The provider builds its
own boto3 client from settings, with dummy credentials from the environment.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandcell_orchestrator.emulator import Faults, MicrovmEmulator, serve_in_thread
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.lambda_microvm import LambdaMicrovmProvider
from sandcell_orchestrator.providers.lambda_settings import LambdaMicrovmSettings
from sandcell_protocol import runtime_session_id
from tests.fixtures.paths import traversable_dir

RUNNER_KEY = "test-runner-key-" + "k" * 32
"""The deployment key under which the tests' runner tokens are derived."""

ProviderFactory = Callable[..., LambdaMicrovmProvider]


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials for the standard chain; nothing read from a real ~/.aws."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTESTINGEMULATOR")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "emulator-secret-" + "s" * 24)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def vm_base() -> Iterator[Path]:
    """A 0711 directory for the emulator's VM roots."""
    with traversable_dir("microvms-") as root:
        yield root


@pytest.fixture
def faults() -> Faults:
    return Faults()


@pytest.fixture
def emulator(vm_base: Path, faults: Faults) -> MicrovmEmulator:
    return MicrovmEmulator(base_dir=vm_base / "vms", faults=faults, sweep_interval_s=0.05)


@pytest.fixture
def emulator_url(emulator: MicrovmEmulator) -> Iterator[str]:
    with serve_in_thread(emulator) as url:
        yield url


def make_settings(emulator_url: str, **overrides: Any) -> LambdaMicrovmSettings:
    fields: dict[str, Any] = {
        "image": "sandcell-runner",
        "endpoint_url": emulator_url,
        "region": "us-east-1",
        "poll_interval_s": 0.05,
        "boot_timeout_s": 20.0,
        "runner_key": RUNNER_KEY,
        "tps": 200.0,
    }
    fields.update(overrides)
    return LambdaMicrovmSettings(**fields)


@pytest.fixture
async def provider_factory(emulator_url: str) -> AsyncIterator[ProviderFactory]:
    """``make(**settings_overrides, **provider_kwargs)``; all closed afterwards."""
    made: list[LambdaMicrovmProvider] = []
    provider_kwargs = {"client", "rate_limiter", "runner_transport", "clock", "sleep"}

    def make(**overrides: Any) -> LambdaMicrovmProvider:
        kwargs = {k: overrides.pop(k) for k in list(overrides) if k in provider_kwargs}
        provider = LambdaMicrovmProvider(make_settings(emulator_url, **overrides), **kwargs)
        made.append(provider)
        return provider

    yield make
    for provider in made:
        await provider.close()


@pytest.fixture
async def provider(provider_factory: ProviderFactory) -> LambdaMicrovmProvider:
    return provider_factory()


@pytest.fixture
async def handles() -> AsyncIterator[list[SandboxHandle]]:
    """Handles a test made; their runner clients are closed afterwards."""
    made: list[SandboxHandle] = []
    yield made
    for handle in made:
        await handle.close()


@pytest.fixture
def session_id() -> str:
    return runtime_session_id("tenant", "user", secrets.token_hex(8))


def vm_id_of(handle: SandboxHandle) -> str:
    return handle.sandbox_id.rpartition("~")[0]


def proxy_get(url: str, path: str, **headers: str) -> httpx.Response:
    """A raw request to a VM endpoint, bypassing the provider's auth."""
    return httpx.get(url.rstrip("/") + path, headers=headers, timeout=10, trust_env=False)


def runner_pid(emulator: MicrovmEmulator, vm_id: str) -> int:
    pid = emulator.fleet.vms[vm_id].pid
    assert pid is not None
    return pid


def process_state(pid: int) -> str:
    """The one-letter state from /proc (``T`` = stopped)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rpartition(")")[2].split()[0]


def state_once_stopped(pid: int, *, timeout_s: float = 10.0) -> str:
    """The state after SIGSTOP has taken effect (or the last one seen at the deadline).

    A stop is delivered when the process next runs: on a loaded machine /proc can
    still say ``R`` just after the signal was sent.
    """
    deadline = time.monotonic() + timeout_s
    state = process_state(pid)
    while state != "T" and time.monotonic() < deadline:
        time.sleep(0.02)
        state = process_state(pid)
    return state
