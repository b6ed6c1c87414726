"""Egress policy and the always-refused addresses: the golden vectors (tests/protocol/golden.json).

The runner's gateway and the orchestrator's webhook guard both decide with these
functions; their own tests assert the same vectors through their own code.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import msgspec
import pytest

from sandcell_protocol import (
    AddressRules,
    EgressPolicy,
    EgressStatus,
    ProtocolError,
    decode,
    encode,
)
from sandcell_protocol.addresses import is_refused_name, literal_address, parse_networks
from sandcell_protocol.egress import EgressReason, parse_rule
from tests.golden import load_golden

GOLDEN = load_golden()
RULES = AddressRules()


@pytest.mark.parametrize("host", GOLDEN["egress_addresses"]["refused"])
def test_always_refused_addresses_in_every_spelling(host: str) -> None:
    address = literal_address(host)
    assert address is not None
    assert not RULES.allows(address)


@pytest.mark.parametrize("host", GOLDEN["egress_addresses"]["allowed"])
def test_public_addresses_are_not_refused(host: str) -> None:
    address = literal_address(host)
    assert address is not None
    assert RULES.allows(address)


def test_an_operator_network_opens_only_itself() -> None:
    """10.213.0.0/16 allowed: its addresses pass in every spelling, the rest of 10/8 does not."""
    rules = AddressRules(parse_networks("10.213.0.0/16"))
    assert rules.allows(ipaddress.ip_address("10.213.4.5"))
    assert rules.allows(ipaddress.ip_address("::ffff:10.213.4.5"))
    assert not rules.allows(ipaddress.ip_address("10.214.0.1"))
    with pytest.raises(ValueError, match="nope"):
        parse_networks("10.0.0.0/8, nope")


def test_vetted_drops_refused_and_maps_ipv4_mapped() -> None:
    found = RULES.vetted(
        ipaddress.ip_address(a) for a in ("::ffff:8.8.8.8", "8.8.8.8", "10.0.0.1", "1.1.1.1")
    )
    assert [str(a) for a in found] == ["8.8.8.8", "1.1.1.1"]


@pytest.mark.parametrize("name", GOLDEN["egress_refused_names"]["refused"])
def test_loopback_and_metadata_names_are_refused(name: str) -> None:
    assert is_refused_name(name)
    assert not RULES.allows_name(name)


@pytest.mark.parametrize("name", GOLDEN["egress_refused_names"]["allowed"])
def test_other_names_are_not_refused_by_name(name: str) -> None:
    assert not is_refused_name(name)


@pytest.mark.parametrize(("raw", "normalized"), GOLDEN["egress_rules"]["accepted"])
def test_rules_accepted_and_normalized(raw: str, normalized: str) -> None:
    assert parse_rule(raw).text == normalized


@pytest.mark.parametrize("raw", GOLDEN["egress_rules"]["rejected"])
def test_rules_rejected(raw: str) -> None:
    with pytest.raises(ValueError, match="egress rule"):
        parse_rule(raw)


def _policy(raw: dict[str, Any]) -> EgressPolicy:
    return msgspec.convert(raw, EgressPolicy)


@pytest.mark.parametrize("vector", GOLDEN["egress_decisions"])
def test_decisions(vector: dict[str, Any]) -> None:
    verdict = _policy(vector["policy"]).decide(
        name=vector["name"],
        addresses=[ipaddress.ip_address(a) for a in vector["addresses"]],
        port=vector["port"],
    )
    assert (verdict.allowed, verdict.reason) == (vector["allowed"], EgressReason(vector["reason"]))


@pytest.mark.parametrize("vector", GOLDEN["egress_may_resolve"])
def test_may_resolve(vector: dict[str, Any]) -> None:
    assert _policy(vector["policy"]).may_resolve(vector["name"]) is vector["answer"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"mode":"deny_all","allow":["pypi.org"]}',
        b'{"mode":"allow","allow":["*"]}',
        b'{"mode":"allow","deny":["a..b"]}',
        b'{"mode":"open"}',
        b'{"mode":"allow","allow":[],"extra":1}',
    ],
)
def test_bad_policies_fail_to_decode(body: bytes) -> None:
    """Wire values are strict: a bad rule, mode or field is an error, not dropped."""
    with pytest.raises(ProtocolError, match="EgressPolicy"):
        decode(body, EgressPolicy)


def test_status_round_trips() -> None:
    status = EgressStatus(
        mechanism="nftables", policy=EgressPolicy(mode="allow", allow=("pypi.org:443",))
    )
    assert decode(encode(status), EgressStatus) == status
