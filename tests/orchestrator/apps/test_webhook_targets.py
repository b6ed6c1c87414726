"""Webhook destinations: only public addresses unless the operator allow-listed a network."""

from __future__ import annotations

import ipaddress

import httpcore
import httpx
import pytest

from sandcell_orchestrator.apps.errors import AppRequestError
from sandcell_orchestrator.apps.routes import app_error
from sandcell_orchestrator.apps.settings import AppSettings
from sandcell_orchestrator.apps.webhook_targets import (
    _HTTPCORE_ERRORS,
    WebhookTargetError,
    WebhookTargets,
    _map_httpcore_errors,
    resolve_host,
)
from sandcell_orchestrator.errors import ConfigError
from sandcell_protocol import ErrorCode

PUBLIC_ONLY = WebhookTargets()
LOOPBACK_V4 = WebhookTargets((ipaddress.ip_network("127.0.0.1/32"),))

REFUSED_URLS = [
    "http://127.0.0.1/hook",
    "http://127.0.0.1.:8080/hook",
    "http://127.1/hook",
    "http://2130706433/hook",
    "http://0x7f000001/hook",
    "http://017700000001/hook",
    "http://0.0.0.0:8000/hook",
    "http://0/hook",
    "http://[::]/hook",
    "http://[::1]:8000/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://10.1.2.3/hook",
    "http://172.16.0.1/hook",
    "http://172.31.255.254/hook",
    "http://192.168.1.1/hook",
    "http://100.64.0.1/hook",
    "http://198.18.0.1/hook",
    "http://224.0.0.1/hook",
    "http://255.255.255.255/hook",
    "http://[fc00::1]/hook",
    "http://[fe80::1]/hook",
    "http://[fec0::1]/hook",
    "http://[ff02::1]/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://[::ffff:169.254.169.254]/hook",
    "http://[::ffff:a00:1]/hook",
    "http://[::127.0.0.1]/hook",
    "http://[2002:7f00:1::]/hook",
    "http://[2002:a9fe:a9fe::1]/hook",
    "http://[64:ff9b::a9fe:a9fe]/hook",
    "http://[64:ff9b:1::1]/hook",
    "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/hook",
    "http://localhost/hook",
    "http://LOCALHOST.:8000/hook",
    "http://hooks.localhost/hook",
    "https://user:pass@hooks.example.com/hook",
    "ftp://hooks.example.com/hook",
]


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_private_loopback_metadata_and_mapped_urls_are_refused(url: str) -> None:
    """Any spelling of a non-public address, or a loopback name, is a bad_request up front."""
    with pytest.raises(WebhookTargetError) as caught:
        PUBLIC_ONLY.check_url(url)
    assert caught.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/sandcell?tenant=a",
        "http://8.8.8.8:8080/hook",
        "http://[2606:4700:4700::1111]/hook",
        "http://[::ffff:8.8.8.8]/hook",
        "http://[2002:808:808::]/hook",
        "http://[64:ff9b::808:808]/hook",
        # Names are resolved, and vetted, when a delivery connects.
        "http://internal.corp.example/hook",
    ],
)
def test_public_destinations_and_names_pass_the_url_check(url: str) -> None:
    PUBLIC_ONLY.check_url(url)


def test_the_refusal_names_the_address_and_the_remedy_not_the_path() -> None:
    """The message a caller (and a log) sees: the address and the variable, no URL secrets."""
    with pytest.raises(WebhookTargetError) as caught:
        PUBLIC_ONLY.check_url("http://2130706433/hook?token=SECRET-TOKEN")
    message = str(caught.value)
    assert "127.0.0.1" in message
    assert "SANDCELL_APP_WEBHOOK_ALLOW_NETS" in message
    assert "SECRET-TOKEN" not in message


def test_a_refusal_is_a_400_bad_request_on_the_api() -> None:
    """Raised from AppInstances.create, it takes the routes' AppRequestError path."""
    error = WebhookTargetError("webhook_url: 127.0.0.1 is not a public address")
    assert isinstance(error, AppRequestError)
    mapped = app_error(error)
    assert mapped is not None
    status, body = mapped
    assert (status, body.error.code) == (400, ErrorCode.BAD_REQUEST)


def test_the_allow_list_admits_only_its_networks() -> None:
    """127.0.0.1/32 lets that receiver in (in any spelling), not the rest of loopback."""
    LOOPBACK_V4.check_url("http://127.0.0.1:8000/hook")
    LOOPBACK_V4.check_url("http://[::ffff:127.0.0.1]:8000/hook")
    for url in ("http://127.0.0.2/hook", "http://[::1]/hook", "http://10.0.0.1/hook"):
        with pytest.raises(WebhookTargetError):
            LOOPBACK_V4.check_url(url)
    # localhost may resolve to ::1 as well as 127.0.0.1: both must be allowed.
    with pytest.raises(WebhookTargetError):
        LOOPBACK_V4.check_url("http://localhost:8000/hook")
    both = WebhookTargets(tuple(ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128")))
    both.check_url("http://localhost:8000/hook")


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("93.184.215.14", True),
        ("2606:4700::6810:84e5", True),
        ("127.0.0.1", False),
        ("169.254.169.254", False),
        ("168.63.129.16", False),  # Azure's metadata host, although public
        ("::ffff:169.254.169.254", False),
        ("::ffff:93.184.215.14", True),
        ("64:ff9b::7f00:1", False),
        ("2002:c0a8:101::1", False),
        ("192.88.99.1", False),
        ("fe80::1%eth0", False),
    ],
)
def test_addresses_are_judged_by_where_packets_go(address: str, allowed: bool) -> None:
    assert PUBLIC_ONLY.allows(ipaddress.ip_address(address)) is allowed


def test_vetting_refuses_if_any_resolved_address_is_not_allowed() -> None:
    """A public answer does not excuse a private one next to it (round-robin rebinding)."""
    public = ipaddress.ip_address("93.184.215.14")
    with pytest.raises(WebhookTargetError, match=r"10\.0\.0\.7"):
        PUBLIC_ONLY.vet("hooks.example.test", [public, ipaddress.ip_address("10.0.0.7")])
    mapped = ipaddress.ip_address("::ffff:93.184.215.14")
    assert PUBLIC_ONLY.vet("hooks.example.test", [public, mapped, public]) == [public]


async def test_the_default_resolver_uses_the_system_lookup() -> None:
    """getaddrinfo (in a thread): numeric hosts are parsed, names come from /etc/hosts or DNS."""
    assert await resolve_host("127.0.0.1", 80) == [ipaddress.ip_address("127.0.0.1")]
    assert await resolve_host("127.1", 80) == [ipaddress.ip_address("127.0.0.1")]
    found = await resolve_host("localhost", 80)
    assert found
    assert all(address.is_loopback for address in found)


def test_every_httpcore_error_is_mapped_to_the_httpx_error_of_that_name() -> None:
    """The transport keeps httpx's contract: no httpcore exception escapes unmapped."""
    exported = [getattr(httpcore, name) for name in httpcore.__all__]
    errors = [
        cls
        for cls in exported
        if isinstance(cls, type)
        and issubclass(cls, Exception)
        # The pool retries this one internally; it never leaves httpcore.
        and cls is not httpcore.ConnectionNotAvailable
    ]
    assert set(errors) == set(_HTTPCORE_ERRORS)
    for cls in errors:
        with pytest.raises(httpx.TransportError) as caught, _map_httpcore_errors():
            raise cls("boom")
        assert type(caught.value) is getattr(httpx, cls.__name__)


def test_settings_read_the_webhook_allow_list() -> None:
    settings = AppSettings.from_env(
        {"SANDCELL_APP_WEBHOOK_ALLOW_NETS": "127.0.0.1/32, 10.0.0.0/8,::1"}
    )
    assert settings.webhook_allow_nets == (
        ipaddress.ip_network("127.0.0.1/32"),
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )
    assert AppSettings.from_env({}).webhook_allow_nets == ()


@pytest.mark.parametrize("raw", ["10.0.0.1/8", "10.0.0.0/33", "localhost", "10.0.0.0/8;rm"])
def test_settings_refuse_a_malformed_allow_list_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="SANDCELL_APP_WEBHOOK_ALLOW_NETS"):
        AppSettings.from_env({"SANDCELL_APP_WEBHOOK_ALLOW_NETS": raw})
