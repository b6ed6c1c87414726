"""A turn's refusals, without a network: the golden event, and the per-turn bound."""

from __future__ import annotations

from sandcell_protocol import EgressEvent, decode, encode, encode_event
from sandcell_runner.egress.turn import TurnRefusals, refused_event
from tests.golden import load_golden

VECTOR = load_golden()["egress_stream_events"]


def test_a_gateway_refusal_becomes_the_golden_stream_line() -> None:
    event = decode(encode(VECTOR["refused"]), EgressEvent)
    assert encode_event(refused_event(event)) == VECTOR["lines"][0].encode() + b"\n"


def test_past_the_limit_refusals_are_only_counted() -> None:
    """The golden limit is kept, the rest counted; ``notify`` only for kept ones."""
    event = decode(encode(VECTOR["refused"]), EgressEvent)
    notified: list[None] = []
    refusals = TurnRefusals(session=False, notify=lambda: notified.append(None))
    assert refusals.omitted() is None
    for _ in range(VECTOR["max_per_turn"] - 1):
        refusals.add(event)
    first = refusals.take()
    for _ in range(4):
        refusals.add(event)
    assert len(first) + len(refusals.take()) == VECTOR["max_per_turn"]
    assert refusals.take() == []
    assert len(notified) == VECTOR["max_per_turn"]
    omitted = refusals.omitted()
    assert omitted is not None
    assert encode(omitted) == b'{"type":"egress_omitted","count":3}'
