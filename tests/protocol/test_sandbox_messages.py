"""``sandbox_messages``: the sandbox-path mapping both sides use, against the golden vectors."""

from __future__ import annotations

import pytest

from sandcell_protocol import ProtocolError, encode
from sandcell_protocol import sandbox_messages as sm
from tests.golden import load_golden

GOLDEN = load_golden()["sandbox_path"]


@pytest.mark.parametrize(("raw", "workspace"), GOLDEN["accepted"])
def test_sandbox_path_accepted(raw: str, workspace: str) -> None:
    assert sm.sandbox_path(raw) == workspace
    if workspace:
        # Its display form maps back to itself.
        assert sm.sandbox_path(sm.sandbox_display_path(workspace)) == workspace


@pytest.mark.parametrize("raw", GOLDEN["rejected"])
def test_sandbox_path_rejected(raw: str) -> None:
    with pytest.raises(ProtocolError):
        sm.sandbox_path(raw)


def test_process_events_round_trip_and_are_strict() -> None:
    """Events are a tagged union; an unknown field or tag is refused."""
    events: list[sm.ProcessEvent] = [
        sm.ProcessStarted(pid=1000),
        sm.ProcessOutput(stream="stderr", data="aGk="),
        sm.ProcessEnded(exit_code=None, signal="SIGKILL", status="signal: killed"),
        sm.ProcessKeepalive(),
    ]
    for event in events:
        assert sm.decode_process_event(encode(event)) == event
    with pytest.raises(ProtocolError):
        sm.decode_process_event(b'{"type": "start", "pid": 1, "host_pid": 2}')
    with pytest.raises(ProtocolError):
        sm.decode_process_event(b'{"type": "exec", "pid": 1}')


def test_fs_requests_are_a_strict_tagged_union() -> None:
    call = sm.FsListDir(path="/home/user", depth=2)
    assert sm.decode_fs_request(encode(call)) == call
    with pytest.raises(ProtocolError):
        sm.decode_fs_request(b'{"type": "chmod", "path": "a"}')
    with pytest.raises(ProtocolError):
        sm.decode_fs_request(b'{"type": "list_dir", "path": "a", "depth": 0}')
