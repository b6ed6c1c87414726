"""MicrovmProxyAuth and ProxyTokenCache with an in-process transport; the log filter."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

import anyio
import httpx
import pytest

from sandcell_orchestrator.providers.lambda_auth import (
    PROXY_PORT_HEADER,
    MicrovmProxyAuth,
    ProxyTokenCache,
    SecretLogFilter,
    decode_run_hook_payload,
    derive_runner_token,
    encode_run_hook_payload,
    install_log_redaction,
)

HEADER = "X-aws-proxy-auth"


class Minter:
    """Counts mints; each mint is a new token value."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> Mapping[str, str]:
        self.count += 1
        await anyio.sleep(0.01)
        return {HEADER: f"proxy-token-{self.count:04d}"}


class Proxy:
    """Accepts only ``valid`` tokens; records what arrived."""

    def __init__(self, *, valid: set[str], refusal: bytes = b'{"message":"expired"}') -> None:
        self.valid = valid
        self.refusal = refusal
        self.seen: list[tuple[str | None, bytes]] = []
        self.ports: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        # The auth resends the same Request object: copy what arrived.
        self.seen.append((request.headers.get(HEADER), request.read()))
        self.ports.append(request.headers.get(PROXY_PORT_HEADER))
        if request.headers.get(HEADER) not in self.valid:
            return httpx.Response(403, content=self.refusal)
        return httpx.Response(200, json={"ok": True})


def client(proxy: Proxy, auth: httpx.Auth) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.MockTransport(proxy), auth=auth, base_url="https://vm.example"
    )


async def test_tokens_are_cached_and_minted_once_for_concurrent_requests() -> None:
    minter = Minter()
    cache = ProxyTokenCache(minter, lifetime_s=3600)
    proxy = Proxy(valid={"proxy-token-0001"})
    async with client(proxy, MicrovmProxyAuth(cache)) as http, anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(http.get, "/health")
    assert minter.count == 1
    assert len(proxy.seen) == 10
    assert all(token == "proxy-token-0001" for token, _ in proxy.seen)
    assert proxy.ports == [None] * 10


async def test_token_is_reminted_before_it_expires() -> None:
    now = [0.0]
    minter = Minter()
    cache = ProxyTokenCache(minter, lifetime_s=600, clock=lambda: now[0])
    first = await cache.current()
    now[0] = 600 - 121  # outside the margin (20% of the lifetime, at most 60 s)
    assert await cache.current() is first
    now[0] = 600 - 59
    second = await cache.current()
    assert second is not first
    assert minter.count == 2
    assert second.expires_at == pytest.approx(now[0] + 600)


async def test_a_proxy_refusal_remints_once_and_resends() -> None:
    """403 from the proxy: one new token, the same request again, success."""
    minter = Minter()
    proxy = Proxy(valid={"proxy-token-0002"})
    async with client(proxy, MicrovmProxyAuth(ProxyTokenCache(minter, lifetime_s=3600))) as http:
        response = await http.post("/v1/execute", content=b'{"code":"print(1)"}')
    assert response.status_code == 200
    assert minter.count == 2
    body = b'{"code":"print(1)"}'
    assert proxy.seen == [("proxy-token-0001", body), ("proxy-token-0002", body)]


async def test_a_refused_fresh_token_is_not_retried_forever() -> None:
    minter = Minter()
    proxy = Proxy(valid=set())
    async with client(proxy, MicrovmProxyAuth(ProxyTokenCache(minter, lifetime_s=3600))) as http:
        response = await http.get("/health")
    assert response.status_code == 403
    assert len(proxy.seen) == 2
    assert minter.count == 2


async def test_the_runners_own_refusal_does_not_remint() -> None:
    """A 401 carrying the runner's ErrorBody is about the bearer token, not the proxy."""
    minter = Minter()
    body = b'{"error":{"code":"unauthorized","message":"invalid bearer token","retryable":false}}'
    proxy = Proxy(valid=set(), refusal=body)
    async with client(proxy, MicrovmProxyAuth(ProxyTokenCache(minter, lifetime_s=3600))) as http:
        response = await http.get("/v1/languages")
    assert response.status_code == 403
    assert len(proxy.seen) == 1
    assert minter.count == 1


async def test_a_streamed_body_is_not_resent_but_the_next_request_gets_a_new_token() -> None:
    minter = Minter()
    proxy = Proxy(valid={"proxy-token-0002"})

    async def chunks() -> AsyncIterator[bytes]:
        yield b"part"

    async with client(proxy, MicrovmProxyAuth(ProxyTokenCache(minter, lifetime_s=3600))) as http:
        refused = await http.post("/v1/session/restore", content=chunks())
        accepted = await http.get("/health")
    assert refused.status_code == 403
    assert accepted.status_code == 200
    assert minter.count == 2
    assert len(proxy.seen) == 2


async def test_a_non_default_port_is_selected_by_header() -> None:
    proxy = Proxy(valid={"proxy-token-0001"})
    auth = MicrovmProxyAuth(ProxyTokenCache(Minter(), lifetime_s=60), port=9000)
    async with client(proxy, auth) as http:
        await http.get("/health")
    assert proxy.ports == ["9000"]


def test_the_auth_refuses_sync_clients() -> None:
    auth = MicrovmProxyAuth(ProxyTokenCache(Minter(), lifetime_s=60))
    with (
        httpx.Client(transport=httpx.MockTransport(Proxy(valid=set())), auth=auth) as http,
        pytest.raises(RuntimeError, match="AsyncClient"),
    ):
        http.get("https://vm.example/health")


def test_reprs_hold_no_token() -> None:
    cache = ProxyTokenCache(Minter(), lifetime_s=60)
    assert "token-" not in repr(cache)
    assert "token-" not in repr(MicrovmProxyAuth(cache))


async def test_a_minted_token_repr_hides_its_headers() -> None:
    token = await ProxyTokenCache(Minter(), lifetime_s=60).current()
    assert "proxy-token" not in repr(token)


def test_runner_tokens_derive_from_key_and_nonce() -> None:
    """Deterministic per (key, nonce), different across nonces and keys; a bearer b64token."""
    token = derive_runner_token(b"k" * 32, "n1")
    assert token == derive_runner_token(b"k" * 32, "n1")
    assert token != derive_runner_token(b"k" * 32, "n2")
    assert token != derive_runner_token(b"j" * 32, "n1")
    assert len(token) == 64
    assert int(token, 16) >= 0


def test_run_hook_payload_round_trip() -> None:
    payload = encode_run_hook_payload("abc123-token")
    assert len(payload) <= 4096  # the service model's limit
    assert decode_run_hook_payload(payload) == "abc123-token"
    assert decode_run_hook_payload("not json") is None
    assert decode_run_hook_payload('{"sandcell": 2, "runner_token": "x"}') is None
    assert decode_run_hook_payload('{"runner_token": "x"}') is None


# Shapes botocore and httpx print at DEBUG.
BOTOCORE_LINES = [
    "Making request for OperationModel(name=RunMicrovm) with params: {'body': "
    'b\'{"imageIdentifier": "img", "runHookPayload": '
    '"{\\\\"sandcell\\\\":1,\\\\"runner_token\\\\":\\\\"SECRET-RUNNER\\\\"}", '
    '"clientToken": "abc"}\'}',
    "Sending http request: <AWSPreparedRequest stream_output=False, method=POST, "
    "url=http://x/2025-09-09/microvms, headers={'Authorization': "
    "b'AWS4-HMAC-SHA256 Credential=AKID/20250101/us-east-1/lambda/aws4_request, "
    "SignedHeaders=host, Signature=0123456789abcdef0123456789abcdef', "
    "'X-Amz-Security-Token': b'SESSION-SECRET'}>",
    'Response body:\nb\'{"authToken": {"X-aws-proxy-auth": "SECRET-PROXY"}}\'',
    "CanonicalRequest:\nPOST\n/\n\nhost:x\nx-amz-security-token:SESSION-SECRET\n\nhost",
    "Signature:\n0123456789abcdef0123456789abcdef0123",
]


@pytest.mark.parametrize("line", BOTOCORE_LINES)
def test_the_log_filter_redacts_the_shapes_secrets_travel_in(line: str) -> None:
    redacted = SecretLogFilter().redact(line)
    for secret in ("SECRET-RUNNER", "SECRET-PROXY", "SESSION-SECRET", "0123456789abcdef0123"):
        assert secret not in redacted
    assert "[redacted]" in redacted


def test_the_log_filter_redacts_remembered_values_and_rewrites_records() -> None:
    log_filter = SecretLogFilter()
    log_filter.remember("a-remembered-secret-value")
    record = logging.LogRecord(
        "botocore.endpoint",
        logging.DEBUG,
        __file__,
        1,
        "got %s",
        ("a-remembered-secret-value",),
        None,
    )
    assert log_filter.filter(record)
    assert record.getMessage() == "got [redacted]"


def test_install_is_idempotent_and_covers_botocore() -> None:
    first = install_log_redaction()
    assert install_log_redaction() is first
    assert first in logging.getLogger("botocore.endpoint").filters
    assert logging.getLogger("botocore.endpoint").filters.count(first) == 1
