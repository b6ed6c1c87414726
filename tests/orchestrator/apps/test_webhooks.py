"""Webhooks: HMAC-signed, retried with backoff, never blocking the caller, never internal."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from sandcell_orchestrator.apps.webhook_targets import IPAddress
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
# The receivers here listen on 127.0.0.1, which is refused unless allow-listed.
LOOPBACK = [ipaddress.ip_network("127.0.0.1/32")]
HOOK_NAME = "hooks.example.test"


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay_s: float) -> None:
        self.delays.append(delay_s)


class FakeDns:
    """A resolver answering from a table, like /etc/hosts; records every lookup."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.lookups: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Sequence[IPAddress]:
        self.lookups.append((host, port))
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(address) for address in self.table[host]]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


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
    async with (
        serve_asgi(receiver.app()) as url,
        WebhookSender(secret=SECRET, allow_nets=LOOPBACK) as sender,
    ):
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
        sender = WebhookSender(
            secret=SECRET, allow_nets=LOOPBACK, sleep=sleep, jitter=lambda: 1.0, base_delay_s=0.5
        )
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
        sender = WebhookSender(secret=SECRET, allow_nets=LOOPBACK, sleep=sleep)
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
        secret=SECRET,
        allow_nets=LOOPBACK,
        sleep=sleep,
        jitter=lambda: 0.0,
        max_attempts=5,
        max_delay_s=1.5,
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
    delivery = Delivery(url="http://x/hook?key=URL-TOKEN", payload={"token": "p"})
    assert "token" not in repr(delivery)
    assert "URL-TOKEN" not in repr(delivery)


@pytest.mark.parametrize("header", ["", "sha256=", "sha1=abc", "sha256=zz"])
def test_malformed_signatures_do_not_verify(header: str) -> None:
    assert not verify_signature(SECRET, b"{}", header)


# -- destinations (server-side request forgery) ---------------------------------------


async def test_private_receivers_are_refused_by_default(caplog: pytest.LogCaptureFixture) -> None:
    """Without an allow-list a loopback receiver gets nothing; refused once, logged cleanly."""
    receiver = Receiver()
    sleep = RecordingSleep()
    caplog.set_level(logging.DEBUG)
    async with serve_asgi(receiver.app()) as url:
        sender = WebhookSender(secret=SECRET, sleep=sleep)
        try:
            delivered = await sender.deliver(
                Delivery(url=f"{url}/hook?token=URL-TOKEN", payload={"n": 1})
            )
        finally:
            await sender.aclose()
    assert not delivered
    assert receiver.calls == []
    assert sleep.delays == []  # not retried
    assert (sender.refused, sender.failed, sender.delivered) == (1, 1, 0)
    (refusal,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert refusal.levelno == logging.WARNING
    assert "127.0.0.1" in refusal.getMessage()
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for secret in (SECRET, "sha256=", "URL-TOKEN"):
        assert secret not in logged


async def test_the_url_is_checked_before_any_lookup() -> None:
    """A literal metadata address is refused without asking DNS or opening a socket."""
    dns = FakeDns({})
    sender = WebhookSender(secret=SECRET, resolver=dns)
    try:
        url = "http://[::ffff:169.254.169.254]/latest/meta-data/"
        assert not await sender.deliver(Delivery(url=url, payload={}))
    finally:
        await sender.aclose()
    assert dns.lookups == []
    assert sender.refused == 1


async def test_a_name_resolving_to_loopback_is_refused_when_sending() -> None:
    """DNS rebinding: the name passes the URL check, but its address is vetted on connect."""
    receiver = Receiver()
    dns = FakeDns({HOOK_NAME: ["127.0.0.1"]})
    sleep = RecordingSleep()
    async with serve_asgi(receiver.app()) as url:
        hook = f"http://{HOOK_NAME}:{_port(url)}/hook"
        sender = WebhookSender(secret=SECRET, resolver=dns, sleep=sleep)
        try:
            sender.check_url(hook)  # what the API accepted: nothing to see in the URL
            assert not await sender.deliver(Delivery(url=hook, payload={}))
        finally:
            await sender.aclose()
    assert receiver.calls == []
    assert dns.lookups == [(HOOK_NAME, _port(url))]
    assert sleep.delays == []
    assert sender.refused == 1


async def test_one_disallowed_address_among_allowed_ones_refuses() -> None:
    """Every resolved address must pass, whichever one a connection would have picked."""
    receiver = Receiver()
    dns = FakeDns({HOOK_NAME: ["127.0.0.1", "10.0.0.7"]})
    async with serve_asgi(receiver.app()) as url:
        hook = f"http://{HOOK_NAME}:{_port(url)}/hook"
        sender = WebhookSender(secret=SECRET, allow_nets=LOOPBACK, resolver=dns)
        try:
            assert not await sender.deliver(Delivery(url=hook, payload={}))
        finally:
            await sender.aclose()
    assert receiver.calls == []
    assert sender.refused == 1


async def test_delivery_connects_to_the_vetted_address_under_the_original_name() -> None:
    """The socket goes to the address vetted (a .test name has no DNS); Host stays the name."""
    receiver = Receiver()
    dns = FakeDns({HOOK_NAME: ["127.0.0.1"]})
    async with serve_asgi(receiver.app()) as url:
        port = _port(url)
        sender = WebhookSender(secret=SECRET, allow_nets=LOOPBACK, resolver=dns)
        try:
            assert await sender.deliver(
                Delivery(url=f"http://{HOOK_NAME}:{port}/hook", payload={"n": 1})
            )
        finally:
            await sender.aclose()
    (call,) = receiver.calls
    assert call.headers["host"] == f"{HOOK_NAME}:{port}"
    assert verify_signature(SECRET, call.body, call.headers[SIGNATURE_HEADER.lower()])
    assert dns.lookups == [(HOOK_NAME, port)]


async def test_tls_is_verified_for_the_name_while_connecting_to_the_vetted_address(
    tmp_path: Path,
) -> None:
    """https: SNI and the certificate check use the URL's name, the socket the vetted IP.

    The server's certificate is for hooks.example.test only: delivery succeeds to
    that name, and fails (not refused: a TLS error) for another name on the same IP.
    """
    client_context, certfile, keyfile = _tls_files(tmp_path, HOOK_NAME)
    receiver = Receiver()
    dns = FakeDns({HOOK_NAME: ["127.0.0.1"], "other.example.test": ["127.0.0.1"]})
    async with serve_asgi(receiver.app(), tls=(certfile, keyfile)) as url:
        port = httpx.URL(url).port
        sender = WebhookSender(
            secret=SECRET,
            allow_nets=LOOPBACK,
            resolver=dns,
            ssl_context=client_context,
            max_attempts=1,
        )
        try:
            good = f"https://{HOOK_NAME}:{port}/hook"
            assert await sender.deliver(Delivery(url=good, payload={"n": 1}))
            wrong = f"https://other.example.test:{port}/hook"
            assert not await sender.deliver(Delivery(url=wrong, payload={"n": 2}))
        finally:
            await sender.aclose()
    (call,) = receiver.calls
    assert json.loads(call.body) == {"n": 1}
    assert call.headers["host"] == f"{HOOK_NAME}:{port}"
    assert sender.refused == 0


async def test_redirects_are_not_followed() -> None:
    """A 307 to another path ends the delivery: the target never sees the signed body."""
    landed: list[bytes] = []

    async def hook(request: Request) -> Response:
        return RedirectResponse(f"{base[0]}/landing", status_code=307)

    async def landing(request: Request) -> Response:
        landed.append(await request.body())
        return Response(status_code=204)

    base: list[str] = []
    app = Starlette(
        routes=[
            Route("/hook", hook, methods=["POST"]),
            Route("/landing", landing, methods=["POST"]),
        ]
    )
    sleep = RecordingSleep()
    async with serve_asgi(app) as url:
        base.append(url)
        sender = WebhookSender(secret=SECRET, allow_nets=LOOPBACK, sleep=sleep)
        try:
            assert not await sender.deliver(Delivery(url=f"{url}/hook", payload={}))
        finally:
            await sender.aclose()
    assert landed == []
    assert sleep.delays == []
    assert sender.failed == 1


# -- TLS helpers ---------------------------------------------------------------------


def _tls_files(tmp_path: Path, name: str) -> tuple[ssl.SSLContext, Path, Path]:
    """A throwaway CA and a server certificate for ``name`` only; a client context trusting it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandcell test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    certfile, keyfile = tmp_path / "server.pem", tmp_path / "server.key"
    certfile.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(
        cadata=ca.public_bytes(serialization.Encoding.PEM).decode()
    )
    return context, certfile, keyfile
