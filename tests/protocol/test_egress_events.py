"""The execute stream's egress events (protocol 1.2): golden lines, strictness, and which
peers get them (``speaks_at_least``); tests/protocol/golden.json ``egress_stream_events``."""

from __future__ import annotations

import pytest

from sandcell_protocol import (
    EGRESS_EVENTS_SINCE,
    MAX_EGRESS_EVENTS_PER_TURN,
    EgressOmittedEvent,
    EgressRefusedEvent,
    ProtocolError,
    decode_event,
    encode_event,
    speaks_at_least,
)
from sandcell_protocol.schema import json_schema
from tests.golden import load_golden

VECTOR = load_golden()["egress_stream_events"]


def test_the_contract_constants_are_the_golden_ones() -> None:
    assert VECTOR["since"] == EGRESS_EVENTS_SINCE
    assert VECTOR["max_per_turn"] == MAX_EGRESS_EVENTS_PER_TURN


@pytest.mark.parametrize("line", VECTOR["lines"])
def test_golden_lines_round_trip(line: str) -> None:
    event = decode_event(line)
    assert isinstance(event, EgressRefusedEvent | EgressOmittedEvent)
    assert encode_event(event) == line.encode() + b"\n"


@pytest.mark.parametrize("line", VECTOR["rejected_lines"])
def test_bad_lines_are_refused(line: str) -> None:
    """A zero count, an unknown reason, a field of another message: all errors."""
    with pytest.raises(ProtocolError, match="StreamEvent"):
        decode_event(line)


@pytest.mark.parametrize("peer", VECTOR["peers_that_get_them"])
def test_peers_at_the_minor_or_later_get_them(peer: str) -> None:
    assert speaks_at_least(peer, EGRESS_EVENTS_SINCE)


@pytest.mark.parametrize("peer", VECTOR["peers_that_do_not"])
def test_older_other_major_and_malformed_peers_do_not(peer: str | None) -> None:
    assert not speaks_at_least(peer, EGRESS_EVENTS_SINCE)


def test_both_events_are_in_the_schema() -> None:
    components = json_schema()["components"]
    assert {"EgressRefusedEvent", "EgressOmittedEvent"} <= set(components)
