"""Webhooks: HMAC-signed, retried with backoff, never blocking the caller."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from sandcell_orchestrator.apps.webhooks import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    Delivery,
    WebhookSender,
    sign,
    verify_signature,
)
from tests.fixtures.runner_process import free_port

from .http_server import serve_asgi
from .receiver import Receiver

SECRET = "webhook-SECRET-0123456789abcdef"


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay_s: float) -> None:
        self.delays.append(delay_s)


def test_signature_is_hmac_sha256_of_the_raw_body() -> None:
    """The header is sha256=<hex HMAC>; verification is exact and constant time."""
    body = b'{"instance_id":"app_1"}'
    expected = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert sign(SECRET, body) == f"sha256={expected}"
    assert verify_signature(SECRET, body, f"sha256={expected}")
    assert not verify_signature(SECRET, body + b" ", f"sha256={expected}")
    assert not verify_signature("another-secret-0123456789", body, f"sha256={expected}")
    assert not verify_signature(SECRET, body, None)


async def test_delivery_is_signed_and_arrives() -> None:
    """A submitted delivery reaches the receiver with a verifiable signature."""
    receiver = Receiver()
    async with serve_asgi(receiver.app()) as url, WebhookSender(secret=SECRET) as sender:
        payload = {"instance_id": "app_1", "error": {"message": "boom"}}
        assert sender.submit(Delivery(url=f"{url}/hook", payload=payload))
        await sender.drain()
        (call,) = await receiver.wait_for(1)
    assert json.loads(call.body) == payload
    assert verify_signature(SECRET, call.body, call.headers[SIGNATURE_HEADER.lower()])
    assert call.headers["content-type"] == "application/json"
    assert SECRET not in json.dumps(call.headers)
    assert sender.delivered == 1


async def test_server_errors_are_retried_with_exponential_backoff() -> None:
    """5xx and 429 are retried after growing delays; the delivery id stays the same."""
    receiver = Receiver(statuses=[500, 503, 429])
    sleep = RecordingSleep()
    async with serve_asgi(receiver.app()) as url:
        sender = WebhookSender(secret=SECRET, sleep=sleep, jitter=lambda: 1.0, base_delay_s=0.5)
        try:
            assert await sender.deliver(Delivery(url=f"{url}/hook", payload={"n": 1}))
        finally:
            await sender.aclose()
    assert len(receiver.calls) == 4
    assert sleep.delays == [0.5, 1.0, 2.0]
    assert len({call.headers[DELIVERY_HEADER.lower()] for call in receiver.calls}) == 1


async def test_client_errors_are_not_retried() -> None:
    """A 4xx other than 408/425/429 means the receiver refuses: give up at once."""
    receiver = Receiver(statuses=[400])
    sleep = RecordingSleep()
    async with serve_asgi(receiver.app()) as url:
        sender = WebhookSender(secret=SECRET, sleep=sleep)
        try:
            assert not await sender.deliver(Delivery(url=f"{url}/hook", payload={}))
        finally:
            await sender.aclose()
    assert len(receiver.calls) == 1
    assert sleep.delays == []
    assert sender.failed == 1


async def test_unreachable_receivers_are_retried_then_given_up() -> None:
    """Connection failures count as retryable, up to max_attempts, capped delays."""
    sleep = RecordingSleep()
    sender = WebhookSender(
        secret=SECRET, sleep=sleep, jitter=lambda: 0.0, max_attempts=5, max_delay_s=1.5
    )
    try:
        url = f"http://127.0.0.1:{free_port()}/hook"
        assert not await sender.deliver(Delivery(url=url, payload={}))
    finally:
        await sender.aclose()
    assert sleep.delays == [0.25, 0.5, 0.75, 0.75]


async def test_submit_never_waits_and_a_full_queue_drops() -> None:
    """submit() is synchronous: with no workers running, the bounded queue fills and drops."""
    sender = WebhookSender(secret=SECRET, queue_size=2)
    try:
        assert sender.submit(Delivery(url="http://127.0.0.1:9/x", payload={}))
        assert sender.submit(Delivery(url="http://127.0.0.1:9/x", payload={}))
        assert not sender.submit(Delivery(url="http://127.0.0.1:9/x", payload={}))
        assert sender.dropped == 1
    finally:
        await sender.aclose()


def test_the_secret_is_not_in_reprs() -> None:
    sender_repr = repr(WebhookSender.__init__)
    assert SECRET not in sender_repr
    delivery = Delivery(url="http://x/hook", payload={"token": "p"})
    assert "token" not in repr(delivery)


@pytest.mark.parametrize("header", ["", "sha256=", "sha1=abc", "sha256=zz"])
def test_malformed_signatures_do_not_verify(header: str) -> None:
    assert not verify_signature(SECRET, b"{}", header)
