"""The ``lambda-microvm`` provider: one sandbox = one AWS Lambda MicroVM.

Lifecycle: ``create`` = RunMicrovm → GetMicrovm until RUNNING → the runner's
``/health`` through the MicroVM's proxy; ``suspend`` = SuspendMicrovm (native:
the VM keeps its id, memory and files); ``resume`` = ResumeMicrovm (the idle
policy also resumes on traffic); ``destroy`` = TerminateMicrovm.

Boundaries: boto3 only behind ``MicrovmApi`` (rate-limited, off the event loop,
errors translated); runner traffic only through ``RunnerClient`` with
``MicrovmProxyAuth``; the polls of a VM's state in ``MicrovmWaits``
(``lambda_waits.py``). Sandbox ids are ``<microvmId>~<nonce>``: the nonce derives
the VM's runner token under the deployment's runner key, so any worker holding
the key reaches any VM and no token is ever stored.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import httpx

from ..errors import SandboxError, SandboxNotFoundError, SandboxUnavailableError, SandcellError
from ..extras import needs_extra
from ..handle import SandboxHandle
from ..runner.answers import DEFAULT_CAPS, AnswerCaps
from ..runner.client import RunnerClient
from ..to_the_end import to_the_end
from .base import (
    SandboxCapabilities,
    SandboxSpec,
)
from .lambda_auth import (
    MicrovmProxyAuth,
    ProxyTokenCache,
    derive_runner_token,
    encode_run_hook_payload,
    install_log_redaction,
)
from .lambda_client import ConflictError, MicrovmApi, VmStatus, make_client
from .lambda_settings import ENV, LambdaMicrovmSettings
from .lambda_waits import TERMINAL, BootDiedError, MicrovmWaits, gone
from .ratelimit import InProcessRateLimiter, RateLimiter

if TYPE_CHECKING:
    from types_boto3_lambda_microvms.client import LambdaMicroVMsClient
    from types_boto3_lambda_microvms.type_defs import RunMicrovmRequestTypeDef

__all__ = ["PROVIDER_NAME", "LambdaMicrovmProvider", "MicrovmMetrics"]

log = logging.getLogger(__name__)

PROVIDER_NAME = "lambda-microvm"
_ID_SEPARATOR = "~"


@dataclass(slots=True)
class MicrovmMetrics:
    """Counters since the provider started; ``provider.metrics`` hands out copies."""

    launches_ok: int = 0
    launches_retried: int = 0
    launches_failed: int = 0
    suspends: int = 0
    resumes: int = 0
    token_mints: int = 0
    throttles: int = 0


def _split_id(sandbox_id: str) -> tuple[str, str]:
    vm_id, sep, nonce = sandbox_id.rpartition(_ID_SEPARATOR)
    if not sep or not vm_id or not nonce:
        raise SandboxNotFoundError(f"{sandbox_id[:80]!r} is not a {PROVIDER_NAME} sandbox id")
    return vm_id, nonce


class LambdaMicrovmProvider:
    """Sandboxes on AWS Lambda MicroVMs. Use as ``async with`` or call ``close()``.

    ``client`` defaults to ``boto3.client("lambda-microvms", ...)`` from the settings;
    ``rate_limiter`` to a Redis bucket when ``settings.redis_url`` is set, else an
    in-process one; ``runner_transport`` is passed to every ``RunnerClient``.
    """

    name = PROVIDER_NAME
    capabilities = SandboxCapabilities(pause_resume=True)

    def __init__(
        self,
        settings: LambdaMicrovmSettings,
        *,
        client: LambdaMicroVMsClient | None = None,
        rate_limiter: RateLimiter | None = None,
        runner_transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        new_nonce: Callable[[], str] = lambda: secrets.token_hex(16),
        new_client_token: Callable[[], str] = lambda: str(uuid.uuid4()),
        answer_caps: AnswerCaps = DEFAULT_CAPS,
    ) -> None:
        self.settings = settings
        # The runner is in the tenant's VM: these bound what it makes us read.
        self._answer_caps = answer_caps
        self._log_filter = install_log_redaction()
        self._owns_client = client is None
        self._owns_limiter = rate_limiter is None
        if rate_limiter is None:
            rate_limiter = _rate_limiter(settings)
        self._limiter = rate_limiter
        self._api = MicrovmApi(
            client if client is not None else make_client(settings),
            limiter=rate_limiter,
            redact=self._log_filter.redact,
            on_throttle=self._count_throttle,
        )
        self._waits = MicrovmWaits(
            self._api,
            poll_interval_s=settings.poll_interval_s,
            boot_timeout_s=settings.boot_timeout_s,
            clock=clock,
            sleep=sleep,
        )
        self._transport = runner_transport
        self._clock = clock
        self._new_nonce = new_nonce
        self._new_client_token = new_client_token
        key = settings.runner_key
        if key is None:
            # Production refuses to start without a key; elsewhere this is a note.
            log.info(
                "%s is unset: runner tokens come from a per-process key, so only this "
                "process can reach the MicroVMs it launches",
                ENV.RUNNER_KEY,
            )
            key = secrets.token_urlsafe(32)
        self._runner_key = key.encode()
        self._tokens: dict[str, ProxyTokenCache] = {}
        self._counters = MicrovmMetrics()
        self._closed = False

    def __repr__(self) -> str:
        return f"LambdaMicrovmProvider(image={self.settings.image!r})"

    async def __aenter__(self) -> LambdaMicrovmProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def metrics(self) -> MicrovmMetrics:
        """Launch outcomes, suspends, resumes, token mints and throttles so far (a copy)."""
        return dataclasses.replace(self._counters)

    def _count_throttle(self) -> None:
        self._counters.throttles += 1

    # -- launch -----------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Launch a MicroVM and return once its runner answers ``/health``.

        A VM that dies while booting is replaced once (new client token); throttling
        and deadlines raise a retryable ``SandboxUnavailableError`` without retrying.
        """
        try:
            handle = await self._launch(spec)
        except BootDiedError as first:
            log.warning("%s; launching a replacement once", first)
            try:
                handle = await self._launch(spec)
            except BootDiedError as second:
                self._counters.launches_failed += 1
                raise SandboxUnavailableError(
                    f"two MicroVMs died during boot (last: {second.reason})"
                ) from None
            except BaseException:
                self._counters.launches_failed += 1
                raise
            self._counters.launches_retried += 1
            return handle
        except BaseException:
            self._counters.launches_failed += 1
            raise
        self._counters.launches_ok += 1
        return handle

    def _run_request(
        self, spec: SandboxSpec, *, runner_token: str, client_token: str
    ) -> RunMicrovmRequestTypeDef:
        s = self.settings
        request: RunMicrovmRequestTypeDef = {
            "imageIdentifier": spec.image or s.image,
            "idlePolicy": {
                "maxIdleDurationSeconds": s.idle_timeout_s,
                "suspendedDurationSeconds": s.retention_s,
                "autoResumeEnabled": True,
            },
            "maximumDurationInSeconds": s.max_duration_s,
            "runHookPayload": encode_run_hook_payload(runner_token),
            "clientToken": client_token,
        }
        if s.image_version:
            request["imageVersion"] = s.image_version
        if s.execution_role_arn:
            request["executionRoleArn"] = s.execution_role_arn
        if s.egress_connectors:
            request["egressNetworkConnectors"] = list(s.egress_connectors)
        if s.ingress_connectors:
            request["ingressNetworkConnectors"] = list(s.ingress_connectors)
        return request

    async def _launch(self, spec: SandboxSpec) -> SandboxHandle:
        nonce = self._new_nonce()
        runner_token = derive_runner_token(self._runner_key, nonce)
        self._log_filter.remember(runner_token)
        request = self._run_request(
            spec, runner_token=runner_token, client_token=self._new_client_token()
        )
        deadline = self._clock() + self.settings.boot_timeout_s
        answer = await self._api.run(request)
        vm_id = answer.get("microvmId")
        if not vm_id:
            # Nothing to terminate it by: its idle policy and maximum duration end it.
            raise SandboxUnavailableError("RunMicrovm: the answer held no microvmId")
        log.info("launched MicroVM %s", vm_id)
        first = VmStatus(answer["state"], answer.get("stateReason", ""), answer["endpoint"])
        try:
            return await self._attach(
                f"{vm_id}{_ID_SEPARATOR}{nonce}", first, runner_token, deadline=deadline
            )
        except BaseException:
            # To its end: under an anyio shield only, a second native cancellation left
            # the MicroVM running (and billed) until its idle policy ended it.
            try:
                await to_the_end(self._terminate_quietly(vm_id))
            finally:
                self._tokens.pop(vm_id, None)
            raise

    async def _attach(
        self, sandbox_id: str, status: VmStatus, runner_token: str, *, deadline: float
    ) -> SandboxHandle:
        """Wait for RUNNING, then for the runner behind the proxy; the ready handle."""
        vm_id, _ = _split_id(sandbox_id)
        status = await self._waits.running(vm_id, status, deadline=deadline)
        handle = self._handle(sandbox_id, self._base_url(vm_id, status.endpoint), runner_token)
        try:
            await self._waits.runner_ready(vm_id, handle, deadline=deadline)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await handle.close()
            raise
        return handle

    def _base_url(self, vm_id: str, endpoint: str) -> str:
        if not endpoint:
            raise SandboxUnavailableError(f"MicroVM {vm_id}: the service reported no endpoint")
        url = endpoint if "://" in endpoint else f"https://{endpoint}"
        if self.settings.production and not url.startswith("https://"):
            raise SandboxError(f"MicroVM {vm_id}: refusing a plaintext endpoint in production")
        return url.rstrip("/")

    def _handle(self, sandbox_id: str, endpoint: str, runner_token: str) -> SandboxHandle:
        vm_id, _ = _split_id(sandbox_id)
        cache = self._tokens.get(vm_id)
        if cache is None:
            cache = self._tokens[vm_id] = ProxyTokenCache(
                lambda: self._mint(vm_id),
                lifetime_s=self.settings.token_lifetime_s,
                clock=self._clock,
            )
        runner = RunnerClient(
            endpoint,
            token=runner_token,
            transport=self._transport,
            auth=MicrovmProxyAuth(cache, port=self.settings.runner_port),
            caps=self._answer_caps,
        )
        return SandboxHandle(
            sandbox_id=sandbox_id,
            provider=self.name,
            runner=runner,
            session_id=None,
            endpoint=endpoint,
        )

    async def _mint(self, vm_id: str) -> Mapping[str, str]:
        minted = await self._api.mint_token(
            vm_id, minutes=self.settings.token_minutes, port=self.settings.runner_port
        )
        for value in minted.values():
            self._log_filter.remember(value)
        self._counters.token_mints += 1
        return minted

    def _runner_token(self, nonce: str) -> str:
        token = derive_runner_token(self._runner_key, nonce)
        self._log_filter.remember(token)
        return token

    async def _terminate_quietly(self, vm_id: str) -> None:
        """Best effort after a failed launch; the idle policy bounds what a failure leaves."""
        try:
            await self._api.terminate(vm_id)
        except SandboxNotFoundError:
            pass
        except SandcellError as exc:
            log.warning("could not terminate MicroVM %s after a failed launch: %s", vm_id, exc)

    # -- the rest of the provider seam ----------------------------------------------

    async def connect(self, sandbox_id: str) -> SandboxHandle:
        """A handle to a live (running or suspended) VM; ``SandboxNotFoundError`` if gone.

        A suspended VM resumes on the handle's first request (auto-resume).
        """
        vm_id, nonce = _split_id(sandbox_id)
        status = await self._api.status(vm_id)
        if status.state in TERMINAL:
            raise gone(vm_id, status)
        endpoint = self._base_url(vm_id, status.endpoint)
        return self._handle(sandbox_id, endpoint, self._runner_token(nonce))

    async def destroy(self, sandbox_id: str) -> None:
        """TerminateMicrovm; a VM already gone (or going) returns quietly."""
        vm_id, _ = _split_id(sandbox_id)
        self._tokens.pop(vm_id, None)
        try:
            await self._api.terminate(vm_id)
        except SandboxNotFoundError:
            return
        except ConflictError:
            if (await self._api.status(vm_id)).state not in TERMINAL:
                raise

    async def suspend(self, sandbox_id: str) -> None:
        """SuspendMicrovm in place: memory, processes and files stay (``NativeSuspend``)."""
        vm_id, _ = _split_id(sandbox_id)
        try:
            await self._api.suspend(vm_id)
        except ConflictError:
            if (await self._api.status(vm_id)).state not in ("SUSPENDING", "SUSPENDED"):
                raise
        await self._waits.state(vm_id, "SUSPENDED")
        self._counters.suspends += 1

    async def resume(self, sandbox_id: str, spec: SandboxSpec) -> SandboxHandle:
        """ResumeMicrovm (if suspended), then wait for the runner; the sandbox id is kept."""
        vm_id, nonce = _split_id(sandbox_id)
        status = await self._api.status(vm_id)
        if status.state == "SUSPENDING":
            await self._waits.state(vm_id, "SUSPENDED")
            status = VmStatus("SUSPENDED", "", status.endpoint)
        if status.state == "SUSPENDED":
            try:
                await self._api.resume(vm_id)
            except ConflictError:
                pass  # woken meanwhile by traffic (auto-resume); the state check follows
            else:
                self._counters.resumes += 1
            status = await self._api.status(vm_id)
        deadline = self._clock() + self.settings.boot_timeout_s
        try:
            return await self._attach(
                sandbox_id, status, self._runner_token(nonce), deadline=deadline
            )
        except BootDiedError as exc:
            raise SandboxNotFoundError(f"MicroVM {vm_id} is gone: {exc.reason}") from None

    async def close(self) -> None:
        """Close the rate limiter and boto3 client this provider made; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._tokens.clear()
        if self._owns_limiter:
            await self._limiter.close()
        if self._owns_client:
            await self._api.close()


def _rate_limiter(settings: LambdaMicrovmSettings) -> RateLimiter:
    """A bucket in Redis shared by every worker when there is one, else in this process."""
    if not settings.redis_url:
        return InProcessRateLimiter(tps=settings.tps)
    with needs_extra("redis", "a shared MicroVM rate limit (SANDCELL_REGISTRY_URL)"):
        from .ratelimit_redis import RedisRateLimiter

    return RedisRateLimiter.from_url(settings.redis_url, tps=settings.tps)
