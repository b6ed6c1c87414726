"""Request shapes and error translation, with botocore's Stubber (no network).

The Stubber sits after botocore's parameter validation, so every stubbed call
here also proves the request is valid against the ``lambda-microvms`` model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import boto3
import botocore.exceptions
import botocore.session
import httpx
import pytest
from botocore.stub import Stubber

from sandcell_orchestrator.errors import (
    ConfigError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
    SandcellError,
)
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.lambda_auth import (
    decode_run_hook_payload,
    derive_runner_token,
    encode_run_hook_payload,
)
from sandcell_orchestrator.providers.lambda_client import (
    ConflictError,
    MicrovmApi,
    _map_botocore_errors,
)
from sandcell_orchestrator.providers.lambda_microvm import LambdaMicrovmProvider
from sandcell_orchestrator.providers.lambda_settings import LambdaMicrovmSettings
from sandcell_orchestrator.providers.ratelimit import InProcessRateLimiter
from sandcell_protocol import PROTOCOL_VERSION

KEY = "stub-runner-key-" + "x" * 32
IMAGE = "arn:aws:lambda:us-east-1:123456789012:microvm-image:sandcell"
IMAGE_ARN = IMAGE
EGRESS = "arn:aws:lambda:us-east-1:123456789012:network-connector:egress"
INGRESS = "arn:aws:lambda:us-east-1:aws:network-connector:aws-network-connector:ALL_INGRESS"
ROLE = "arn:aws:iam::123456789012:role/sandcell-microvm"
ENDPOINT = "mvm-1.lambda-microvm.us-east-1.on.aws"
USED_OPERATIONS = (
    "RunMicrovm",
    "GetMicrovm",
    "CreateMicrovmAuthToken",
    "SuspendMicrovm",
    "ResumeMicrovm",
    "TerminateMicrovm",
)
METHODS = {
    "RunMicrovm": "run_microvm",
    "GetMicrovm": "get_microvm",
    "CreateMicrovmAuthToken": "create_microvm_auth_token",
    "SuspendMicrovm": "suspend_microvm",
    "ResumeMicrovm": "resume_microvm",
    "TerminateMicrovm": "terminate_microvm",
}
EXPECTED_ERRORS: dict[str, type[SandcellError]] = {
    "ThrottlingException": SandboxUnavailableError,
    "InternalServerException": SandboxUnavailableError,
    "InsufficientCapacityException": SandboxUnavailableError,
    "ServiceQuotaExceededException": SandboxUnavailableError,
    "ConflictException": ConflictError,
    "ResourceNotFoundException": SandboxNotFoundError,
    "AccessDeniedException": SandboxError,
    "ValidationException": SandboxError,
}

MODEL = botocore.session.get_session().get_service_model("lambda-microvms")
ERROR_CASES = [
    (operation, shape.name, shape.metadata["error"]["httpStatusCode"])
    for operation in USED_OPERATIONS
    for shape in MODEL.operation_model(operation).error_shapes
]


@pytest.fixture
def boto_client() -> Iterator[Any]:
    client = boto3.client(
        "lambda-microvms",
        region_name="us-east-1",
        aws_access_key_id="AKIDSTUB",
        aws_secret_access_key="stub-secret",
    )
    yield client
    client.close()


@pytest.fixture
def stubber(boto_client: Any) -> Iterator[Stubber]:
    with Stubber(boto_client) as stub:
        yield stub
        stub.assert_no_pending_responses()


def vm_answer(state: str) -> dict[str, Any]:
    return {
        "microvmId": "mvm-1",
        "state": state,
        "endpoint": ENDPOINT,
        "imageArn": IMAGE_ARN,
        "imageVersion": "7.0",
        "maximumDurationInSeconds": 7200,
        "startedAt": 1_700_000_000,
    }


class FakeRunnerBehindProxy:
    """Answers /health only with the minted proxy token and the derived bearer."""

    def __init__(self, *, proxy_token: str, runner_token: str) -> None:
        self.proxy_token = proxy_token
        self.runner_token = runner_token
        self.urls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.urls.append(str(request.url))
        if request.headers.get("X-aws-proxy-auth") != self.proxy_token:
            return httpx.Response(403, json={"message": "bad proxy token"})
        health = {"status": "ok", "protocol": PROTOCOL_VERSION, "runner_version": "0.1.0"}
        return httpx.Response(200, json=health)


@pytest.fixture
async def stubbed_provider(
    boto_client: Any, stubber: Stubber
) -> AsyncIterator[tuple[LambdaMicrovmProvider, FakeRunnerBehindProxy]]:
    settings = LambdaMicrovmSettings(
        image=IMAGE,
        image_version="7.0",
        execution_role_arn=ROLE,
        egress_connectors=(EGRESS,),
        ingress_connectors=(INGRESS,),
        region="us-east-1",
        token_minutes=30,
        boot_timeout_s=5,
        max_duration_s=7200,
        retention_s=900,
        idle_timeout_s=600,
        runner_key=KEY,
        poll_interval_s=0.01,
        production=True,
    )
    runner = FakeRunnerBehindProxy(
        proxy_token="minted-proxy-token", runner_token=derive_runner_token(KEY.encode(), "n1")
    )
    provider = LambdaMicrovmProvider(
        settings,
        client=boto_client,
        runner_transport=httpx.MockTransport(runner),
        new_nonce=lambda: "n1",
        new_client_token=lambda: "client-token-1",
    )
    yield provider, runner
    await provider.close()


async def test_run_and_token_requests_have_the_exact_modelled_shape(
    stubbed_provider: tuple[LambdaMicrovmProvider, FakeRunnerBehindProxy], stubber: Stubber
) -> None:
    """RunMicrovm and CreateMicrovmAuthToken, parameter for parameter."""
    provider, runner = stubbed_provider
    runner_token = derive_runner_token(KEY.encode(), "n1")
    stubber.add_response(
        "run_microvm",
        vm_answer("PENDING"),
        expected_params={
            "imageIdentifier": IMAGE,
            "imageVersion": "7.0",
            "executionRoleArn": ROLE,
            "egressNetworkConnectors": [EGRESS],
            "ingressNetworkConnectors": [INGRESS],
            "idlePolicy": {
                "maxIdleDurationSeconds": 600,
                "suspendedDurationSeconds": 900,
                "autoResumeEnabled": True,
            },
            "maximumDurationInSeconds": 7200,
            "runHookPayload": encode_run_hook_payload(runner_token),
            "clientToken": "client-token-1",
        },
    )
    stubber.add_response("get_microvm", vm_answer("RUNNING"), {"microvmIdentifier": "mvm-1"})
    stubber.add_response(
        "create_microvm_auth_token",
        {"authToken": {"X-aws-proxy-auth": "minted-proxy-token"}},
        expected_params={
            "microvmIdentifier": "mvm-1",
            "expirationInMinutes": 30,
            "allowedPorts": [{"port": 8080}],
        },
    )

    handle = await provider.create(SandboxSpec())
    await handle.close()

    assert handle.sandbox_id == "mvm-1~n1"
    assert handle.endpoint == f"https://{ENDPOINT}"
    assert runner.urls == [f"https://{ENDPOINT}/health"]
    assert provider.metrics.launches_ok == 1


async def test_the_runner_token_rides_only_the_run_hook_payload(
    stubbed_provider: tuple[LambdaMicrovmProvider, FakeRunnerBehindProxy], stubber: Stubber
) -> None:
    """What the image's run hook gets is the token the key derives; nothing else carries it."""
    provider, _ = stubbed_provider
    request = provider._run_request(SandboxSpec(), runner_token="t" * 64, client_token="c")
    assert decode_run_hook_payload(request["runHookPayload"]) == "t" * 64
    others = {k: v for k, v in request.items() if k != "runHookPayload"}
    assert "t" * 64 not in repr(others)


def test_the_model_has_no_error_we_have_not_decided_about() -> None:
    """A botocore update adding an error code fails here until it is mapped on purpose."""
    assert {code for _, code, _ in ERROR_CASES} == set(EXPECTED_ERRORS)


def _api(client: Any) -> tuple[MicrovmApi, list[int]]:
    throttles: list[int] = []
    api = MicrovmApi(
        client,
        limiter=InProcessRateLimiter(tps=1000),
        redact=lambda text: text.replace("SECRET-IN-MESSAGE", "[redacted]"),
        on_throttle=lambda: throttles.append(1),
    )
    return api, throttles


async def _invoke(api: MicrovmApi, operation: str) -> None:
    if operation == "RunMicrovm":
        await api.run({"imageIdentifier": IMAGE})
    elif operation == "GetMicrovm":
        await api._call("GetMicrovm", lambda: api._client.get_microvm(microvmIdentifier="m"))
    elif operation == "CreateMicrovmAuthToken":
        await api.mint_token("m", minutes=5, port=8080)
    elif operation == "SuspendMicrovm":
        await api.suspend("m")
    elif operation == "ResumeMicrovm":
        await api.resume("m")
    else:
        await api.terminate("m")


@pytest.mark.parametrize(("operation", "code", "status"), ERROR_CASES)
async def test_every_modelled_error_becomes_one_of_ours(
    boto_client: Any, stubber: Stubber, operation: str, code: str, status: int
) -> None:
    """Each error code → its orchestrator error, retryable as decided, no botocore object."""
    expected = EXPECTED_ERRORS[code]
    stubber.add_client_error(
        METHODS[operation],
        service_error_code=code,
        service_message="with SECRET-IN-MESSAGE inside",
        http_status_code=status,
    )
    api, throttles = _api(boto_client)
    with pytest.raises(SandcellError) as caught:
        await _invoke(api, operation)
    assert type(caught.value) is expected
    assert caught.value.retryable is issubclass(expected, SandboxUnavailableError)
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__
    assert "SECRET-IN-MESSAGE" not in str(caught.value)
    assert code in str(caught.value)
    assert throttles == ([1] if code == "ThrottlingException" else [])


async def test_status_of_a_forgotten_vm_reads_terminated(
    boto_client: Any, stubber: Stubber
) -> None:
    stubber.add_client_error("get_microvm", "ResourceNotFoundException", http_status_code=404)
    api, _ = _api(boto_client)
    status = await api.status("gone")
    assert status.state == "TERMINATED"


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (
            botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"),
            SandboxUnavailableError,
        ),
        (botocore.exceptions.ConnectTimeoutError(endpoint_url="http://x"), SandboxUnavailableError),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), SandboxUnavailableError),
        (botocore.exceptions.NoCredentialsError(), ConfigError),
        (botocore.exceptions.PartialCredentialsError(provider="env", cred_var="x"), ConfigError),
        (botocore.exceptions.NoRegionError(), ConfigError),
        (botocore.exceptions.ParamValidationError(report="bad SECRET-IN-MESSAGE"), SandboxError),
        (botocore.exceptions.BotoCoreError(), SandboxUnavailableError),
        (
            botocore.exceptions.ClientError(
                {"Error": {"Code": "TooManyRequestsException"}, "ResponseMetadata": {}}, "Op"
            ),
            SandboxUnavailableError,
        ),
        (
            botocore.exceptions.ClientError(
                {"Error": {"Code": "Brand new"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "Op"
            ),
            SandboxUnavailableError,
        ),
        (
            botocore.exceptions.ClientError(
                {"Error": {"Code": "Brand new"}, "ResponseMetadata": {"HTTPStatusCode": 418}}, "Op"
            ),
            SandboxError,
        ),
    ],
)
def test_transport_and_client_failures_are_mapped(raised: Exception, expected: type) -> None:
    with (
        pytest.raises(SandcellError) as caught,
        _map_botocore_errors("Op", redact=lambda t: t.replace("SECRET-IN-MESSAGE", "[redacted]")),
    ):
        raise raised
    assert type(caught.value) is expected
    assert "SECRET-IN-MESSAGE" not in str(caught.value)
