"""The gateway's decisions and parsers, without a network: golden vectors and real ClientHellos."""

from __future__ import annotations

import ipaddress
import ssl
from typing import Any

import msgspec
import pytest

from sandcell_protocol import AddressRules, EgressEvent, EgressPolicy
from sandcell_protocol.addresses import IPAddress, literal_address
from sandcell_protocol.egress import EgressReason
from sandcell_runner.egress.decide import Decider, Upstream
from sandcell_runner.egress.sniff import request_head, split_host_port, tls_server_name
from tests.golden import load_golden

GOLDEN = load_golden()


def _decider(
    policy: EgressPolicy, *, local: frozenset[str] = frozenset()
) -> tuple[Decider, list[EgressEvent]]:
    events: list[EgressEvent] = []
    decider = Decider(
        rules=AddressRules(),
        upstream=Upstream("192.0.2.53", 53),  # never asked: these decisions need no lookup
        emit=events.append,
        policy=policy,
        is_local=lambda a: str(a) in local,
    )
    return decider, events


@pytest.mark.parametrize("host", GOLDEN["egress_addresses"]["refused"])
def test_golden_refused_addresses_are_refused_even_under_allow_all(host: str) -> None:
    decider, events = _decider(EgressPolicy(mode="allow_all"))
    address = literal_address(host)
    assert address is not None
    decision = decider.by_address(address, 443, transport="tcp")
    assert (decision.allowed, decision.reason) == (False, EgressReason.REFUSED_ADDRESS)
    assert events[-1].verdict == "refused"


@pytest.mark.parametrize("host", GOLDEN["egress_addresses"]["allowed"])
def test_golden_public_addresses_pass_under_allow_all(host: str) -> None:
    decider, _ = _decider(EgressPolicy(mode="allow_all"))
    address = literal_address(host)
    assert address is not None
    assert decider.by_address(address, 443, transport="tcp").allowed


def test_the_hosts_own_addresses_are_refused() -> None:
    decider, _ = _decider(EgressPolicy(mode="allow_all"), local=frozenset({"8.8.8.8"}))
    decision = decider.by_address(ipaddress.ip_address("8.8.8.8"), 80, transport="tcp")
    assert decision.reason is EgressReason.REFUSED_ADDRESS


@pytest.mark.parametrize("name", GOLDEN["egress_refused_names"]["refused"])
async def test_golden_refused_names_get_no_dns_answer(name: str) -> None:
    decider, events = _decider(EgressPolicy(mode="allow_all"))
    reason, addresses = await decider.answer_a(name)
    assert (reason, addresses) == (EgressReason.REFUSED_NAME, [])
    assert events[-1].transport == "dns"


@pytest.mark.parametrize(
    "vector",
    [v for v in GOLDEN["egress_decisions"] if v["name"] is None],
)
def test_golden_address_decisions(vector: dict[str, Any]) -> None:
    """The gateway's address path agrees with the protocol's vectors (allow-listed nets)."""
    policy = msgspec.convert(vector["policy"], EgressPolicy)
    decider, _ = _decider(policy)
    decider.rules = AddressRules((ipaddress.ip_network("10.0.0.0/8"),))
    address: IPAddress = ipaddress.ip_address(vector["addresses"][0])
    decision = decider.by_address(address, vector["port"], transport="tcp")
    assert (decision.allowed, decision.reason.value) == (vector["allowed"], vector["reason"])


def _client_hello(server_name: str) -> bytes:
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("name", ["pypi.org", "files.pythonhosted.org", "A.Example.COM"])
def test_sni_of_a_real_client_hello(name: str) -> None:
    assert tls_server_name(_client_hello(name)) == name.lower()


@pytest.mark.parametrize(
    "data",
    [b"", b"\x16\x03\x01", b"GET / HTTP/1.1\r\n\r\n", b"\x16" + b"\xff" * 200],
)
def test_sni_of_anything_else_is_none(data: bytes) -> None:
    assert tls_server_name(data) is None


def test_truncated_client_hellos_never_raise() -> None:
    hello = _client_hello("pypi.org")
    for cut in range(len(hello)):
        tls_server_name(hello[:cut])


def test_request_heads() -> None:
    head = request_head(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\nrest")
    assert head is not None
    assert (head.method, head.target, head.header("HOST")) == (
        "CONNECT",
        "pypi.org:443",
        "pypi.org:443",
    )
    assert request_head(b"GET / HTTP/1.1\r\n") is None  # incomplete
    assert request_head(b"GET /\r\n\r\n") is None
    assert request_head(b"GET / HTTP/1.1\r\n bad: x\r\n\r\n") is None


@pytest.mark.parametrize(
    ("authority", "expected"),
    [
        ("pypi.org", ("pypi.org", 80)),
        ("pypi.org:8443", ("pypi.org", 8443)),
        ("[2001:db8::1]:443", ("2001:db8::1", 443)),
        ("[2001:db8::1]", ("2001:db8::1", 80)),
        ("pypi.org:0", None),
        ("pypi.org:x", None),
        ("[::1", None),
        (":80", None),
    ],
)
def test_split_host_port(authority: str, expected: tuple[str, int] | None) -> None:
    assert split_host_port(authority, 80) == expected
