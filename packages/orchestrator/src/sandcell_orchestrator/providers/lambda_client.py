"""The low layer of the Lambda MicroVM provider: one method per control-plane call.

``MicrovmApi`` maps 1:1 onto boto3's ``lambda-microvms`` client. Every call is
admitted by a per-operation token bucket, runs in a worker thread (boto3
blocks), and has its botocore exceptions translated by ``_map_botocore_errors``
into ``SandcellError``s that carry no credential and no botocore object.

    ThrottlingException, TooManyRequests, HTTP 429   SandboxUnavailableError (counted)
    ResourceNotFoundException, HTTP 404              SandboxNotFoundError
    ConflictException, HTTP 409                      ConflictError (a SandboxUnavailableError)
    InternalServer, InsufficientCapacity, quota, 5xx SandboxUnavailableError
    AccessDenied, Validation, other 4xx              SandboxError (not retryable)
    no credentials / no region                       ConfigError
    connection failures, timeouts (BotoCoreError)    SandboxUnavailableError
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import anyio.to_thread
import boto3
import botocore.config
import botocore.exceptions

from ..errors import ConfigError, SandboxError, SandboxNotFoundError, SandboxUnavailableError
from .lambda_settings import ENV, LambdaMicrovmSettings
from .ratelimit import RateLimiter

if TYPE_CHECKING:
    from types_boto3_lambda_microvms.client import LambdaMicroVMsClient
    from types_boto3_lambda_microvms.type_defs import (
        RunMicrovmRequestTypeDef,
        RunMicrovmResponseTypeDef,
    )

__all__ = ["ConflictError", "MicrovmApi", "VmStatus", "make_client"]

T = TypeVar("T")

THROTTLE_CODES = frozenset(
    {"ThrottlingException", "TooManyRequestsException", "Throttling", "RequestLimitExceeded"}
)
NOT_FOUND_CODES = frozenset({"ResourceNotFoundException", "NotFoundException"})
UNAVAILABLE_CODES = frozenset(
    {
        "InternalServerException",
        "ServiceUnavailableException",
        "InsufficientCapacityException",
        "ServiceQuotaExceededException",
    }
)
_MESSAGE_CHARS = 300


class ConflictError(SandboxUnavailableError):
    """ConflictException: the VM's state forbids the call now (e.g. it is mid-suspend)."""


@contextlib.contextmanager
def _map_botocore_errors(
    operation: str,
    *,
    on_throttle: Callable[[], None] = lambda: None,
    redact: Callable[[str], str] = lambda text: text,
) -> Iterator[None]:
    """Translate botocore's exceptions into ``SandcellError``s carrying no credential.

    Raised ``from None``: botocore's exceptions hold the request and the response.
    """
    try:
        yield
    except botocore.exceptions.ClientError as exc:
        error = exc.response.get("Error", {})
        meta = exc.response.get("ResponseMetadata", {})
        code = str(error.get("Code") or "Unknown")
        status = int(meta.get("HTTPStatusCode") or 0)
        detail = redact(str(error.get("Message") or ""))[:_MESSAGE_CHARS]
        message = f"{operation}: {code} (HTTP {status}, request {meta.get('RequestId', '?')})"
        message += f": {detail}" if detail else ""
        if code in THROTTLE_CODES or status == 429:
            on_throttle()
            raise SandboxUnavailableError(f"{message}; throttled, retry later") from None
        if code in NOT_FOUND_CODES or status == 404:
            raise SandboxNotFoundError(message) from None
        if code == "ConflictException" or status == 409:
            raise ConflictError(message) from None
        if code in UNAVAILABLE_CODES or status >= 500:
            raise SandboxUnavailableError(message) from None
        raise SandboxError(message) from None
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError):
        raise ConfigError(
            f"{operation}: no usable AWS credentials (standard credential chain)"
        ) from None
    except botocore.exceptions.NoRegionError:
        raise ConfigError(f"{operation}: no AWS region; set {ENV.REGION}") from None
    except botocore.exceptions.ParamValidationError as exc:
        detail = redact(str(exc))[:_MESSAGE_CHARS]
        raise SandboxError(f"{operation}: invalid request: {detail}") from None
    except botocore.exceptions.BotoCoreError as exc:
        # Connection failures, timeouts, credential refresh errors: nothing done, try later.
        raise SandboxUnavailableError(
            f"{operation}: control plane unreachable ({type(exc).__name__})"
        ) from None


def make_client(settings: LambdaMicrovmSettings) -> LambdaMicroVMsClient:
    """The boto3 client (credentials: the standard chain); create it once.

    botocore's own retries are off: a throttle must reach the caller as a
    retryable error, not become a hidden retry storm against the account limit.
    """
    config = botocore.config.Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=5,
        read_timeout=30,
        max_pool_connections=32,
    )
    with _map_botocore_errors("client"):
        return boto3.client(
            "lambda-microvms",
            endpoint_url=settings.endpoint_url or None,
            region_name=settings.region,
            config=config,
        )


@dataclass(frozen=True, slots=True)
class VmStatus:
    """What GetMicrovm says about a VM (``TERMINATED`` once the service forgot it)."""

    state: str
    reason: str
    endpoint: str


class MicrovmApi:
    """Control-plane calls: rate-limited, off the event loop, errors translated."""

    def __init__(
        self,
        client: LambdaMicroVMsClient,
        *,
        limiter: RateLimiter,
        redact: Callable[[str], str],
        on_throttle: Callable[[], None],
    ) -> None:
        self._client = client
        self._limiter = limiter
        self._redact = redact
        self._on_throttle = on_throttle

    def __repr__(self) -> str:
        return f"MicrovmApi(limiter={self._limiter!r})"

    async def _call(self, operation: str, call: Callable[[], T]) -> T:
        await self._limiter.acquire(operation)
        with _map_botocore_errors(operation, on_throttle=self._on_throttle, redact=self._redact):
            return await anyio.to_thread.run_sync(call)

    async def run(self, request: RunMicrovmRequestTypeDef) -> RunMicrovmResponseTypeDef:
        """RunMicrovm."""
        return await self._call("RunMicrovm", lambda: self._client.run_microvm(**request))

    async def status(self, vm_id: str) -> VmStatus:
        """GetMicrovm; a VM the service no longer knows reads as TERMINATED."""
        try:
            got = await self._call(
                "GetMicrovm", lambda: self._client.get_microvm(microvmIdentifier=vm_id)
            )
        except SandboxNotFoundError:
            return VmStatus("TERMINATED", "not found", "")
        return VmStatus(got["state"], got.get("stateReason", ""), got.get("endpoint", ""))

    async def mint_token(self, vm_id: str, *, minutes: int, port: int) -> dict[str, str]:
        """CreateMicrovmAuthToken for one port; the header map to send."""
        answer = await self._call(
            "CreateMicrovmAuthToken",
            lambda: self._client.create_microvm_auth_token(
                microvmIdentifier=vm_id, expirationInMinutes=minutes, allowedPorts=[{"port": port}]
            ),
        )
        minted = dict(answer.get("authToken") or {})
        if not minted:
            raise SandboxUnavailableError("CreateMicrovmAuthToken: the answer held no token")
        return minted

    async def suspend(self, vm_id: str) -> None:
        """SuspendMicrovm."""
        await self._call(
            "SuspendMicrovm", lambda: self._client.suspend_microvm(microvmIdentifier=vm_id)
        )

    async def resume(self, vm_id: str) -> None:
        """ResumeMicrovm."""
        await self._call(
            "ResumeMicrovm", lambda: self._client.resume_microvm(microvmIdentifier=vm_id)
        )

    async def terminate(self, vm_id: str) -> None:
        """TerminateMicrovm."""
        await self._call(
            "TerminateMicrovm", lambda: self._client.terminate_microvm(microvmIdentifier=vm_id)
        )

    async def close(self) -> None:
        """Close boto3's connection pool."""
        await anyio.to_thread.run_sync(self._client.close)
