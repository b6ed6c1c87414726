"""No credential in any log line or exception text, with every logger at DEBUG."""

from __future__ import annotations

import logging
import os

import httpx
import pytest

from sandcell_orchestrator.emulator import Faults, MicrovmEmulator
from sandcell_orchestrator.errors import SandcellError
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.lambda_auth import derive_runner_token
from sandcell_orchestrator.providers.lambda_microvm import LambdaMicrovmProvider
from sandcell_protocol import ExecuteRequest

from .conftest import RUNNER_KEY, ProviderFactory, vm_id_of


def secrets_of(emulator: MicrovmEmulator, handles: list[SandboxHandle]) -> set[str]:
    """Every credential that existed during the test."""
    found = {
        RUNNER_KEY,
        os.environ["AWS_SECRET_ACCESS_KEY"],
        *emulator.proxy.tokens.values(),
        *(
            derive_runner_token(RUNNER_KEY.encode(), h.sandbox_id.rpartition("~")[2])
            for h in handles
        ),
    }
    return {value for value in found if value}


async def test_debug_logs_and_errors_hold_no_credential(
    provider_factory: ProviderFactory,
    emulator: MicrovmEmulator,
    emulator_url: str,
    faults: Faults,
    handles: list[SandboxHandle],
    session_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Launch, mint, re-mint, execute, suspend, resume, fail: botocore and httpx at DEBUG."""
    caplog.set_level(logging.DEBUG)
    for name in ("botocore", "urllib3", "httpx", "httpcore", "sandcell_orchestrator"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    provider: LambdaMicrovmProvider = provider_factory()
    faults.boot_death_on_launch = {1}
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    errors: list[BaseException] = []

    await handle.runner.execute(ExecuteRequest(language="python", code="print(1)"))
    emulator.clock.advance(3601)  # every proxy token expires: re-mint on 403
    await handle.runner.execute(
        ExecuteRequest(language="python", code="print(2)"), session_id=session_id
    )
    await provider.suspend(handle.sandbox_id)
    handles.append(await provider.resume(handle.sandbox_id, SandboxSpec()))
    try:
        await handle.runner.execute(ExecuteRequest(language="no-such-language", code=""))
    except SandcellError as exc:
        errors.append(exc)
    faults.throttle = {"CreateMicrovmAuthToken": 1}
    provider._tokens[vm_id_of(handle)]._token = None
    try:
        await handle.runner.health()
    except SandcellError as exc:
        errors.append(exc)
    known = secrets_of(emulator, handles)
    async with httpx.AsyncClient(trust_env=False) as admin:
        await admin.post(f"{emulator_url}/_emulator/vms/{vm_id_of(handle)}/kill")
    try:
        await handle.runner.execute(ExecuteRequest(language="python", code="print(3)"))
    except SandcellError as exc:
        errors.append(exc)
    known |= secrets_of(emulator, handles)
    await provider.destroy(handle.sandbox_id)

    assert len(errors) == 3
    assert len(known) >= 5
    assert provider.metrics.token_mints == 2
    assert provider.metrics.throttles == 1
    assert any("runHookPayload" in r.getMessage() for r in caplog.records)
    assert any("authToken" in r.getMessage() for r in caplog.records)
    text = caplog.text + "\n".join(f"{e!s} {e!r}" for e in errors)
    leaked = sorted(secret for secret in known if secret in text)
    assert leaked == []
    assert "AWS4-HMAC-SHA256 Credential" not in text
