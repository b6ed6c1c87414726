"""The golden vectors are the contract: these exact values, from golden.json."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from sandcell_protocol import (
    ExecCall,
    FileRef,
    ProtocolError,
    checkpoint_key,
    checkpoint_prefix,
    decode,
    escape_name,
    input_cache_key,
    is_escaped_name,
    is_runtime_session_id,
    legacy_checkpoint_key,
    parse_checkpoint_key,
    redact_secrets,
    runtime_session_id,
    scoped_storage_session,
    unescape_name,
    validate_input_ref,
    validate_user_id,
    validate_workspace_path,
)
from tests.golden import load_golden

GOLDEN = load_golden()


@pytest.mark.parametrize("vector", GOLDEN["input_cache_key"])
def test_input_cache_key_golden(vector: dict[str, str]) -> None:
    assert input_cache_key(vector["storage_session"], vector["object_id"]) == vector["key"]


def test_input_cache_key_is_not_space_joined() -> None:
    """The NUL separator is the point: a space join gives a different key."""
    vector = GOLDEN["input_cache_key_not_space_joined"]
    key = input_cache_key(vector["storage_session"], vector["object_id"])
    space = f"{vector['storage_session']} {vector['object_id']}".encode()
    assert key != hashlib.sha256(space).hexdigest()


@pytest.mark.parametrize("vector", GOLDEN["runtime_session_id"])
def test_runtime_session_id_golden(vector: dict[str, str]) -> None:
    got = runtime_session_id(vector["namespace"], vector["user_id"], vector["hint"])
    assert got == vector["id"]
    assert is_runtime_session_id(got)


@pytest.mark.parametrize("vector", GOLDEN["checkpoint_key"])
def test_checkpoint_key_golden(vector: dict[str, Any]) -> None:
    key = checkpoint_key(vector["runtime_session_id"], vector["generation"])
    assert key == vector["key"]
    assert parse_checkpoint_key(key) == (vector["runtime_session_id"], vector["generation"])
    assert key.startswith(checkpoint_prefix(vector["runtime_session_id"]))


@pytest.mark.parametrize("vector", GOLDEN["checkpoint_prefix"])
def test_checkpoint_prefix_golden(vector: dict[str, str]) -> None:
    assert checkpoint_prefix(vector["runtime_session_id"]) == vector["prefix"]


def test_checkpoint_keys_sort_by_generation() -> None:
    """Plain string order of the keys is generation order: the latest is the greatest."""
    vector = GOLDEN["checkpoint_key_order"]
    keys = [checkpoint_key(vector["runtime_session_id"], g) for g in vector["generations"]]
    assert sorted(keys) == keys


@pytest.mark.parametrize("key", GOLDEN["checkpoint_key_not_parsed"])
def test_other_keys_are_not_checkpoint_keys(key: str) -> None:
    assert parse_checkpoint_key(key) is None


@pytest.mark.parametrize("vector", GOLDEN["legacy_checkpoint_key"])
def test_legacy_checkpoint_key_golden(vector: dict[str, str]) -> None:
    assert legacy_checkpoint_key(vector["runtime_session_id"]) == vector["key"]
    assert parse_checkpoint_key(vector["key"]) is None


@pytest.mark.parametrize("generation", [0, -1, True, 10**20, 1.0])
def test_checkpoint_key_refuses_a_bad_generation(generation: Any) -> None:
    session = GOLDEN["checkpoint_key"][0]["runtime_session_id"]
    with pytest.raises(ProtocolError, match="generation"):
        checkpoint_key(session, generation)


@pytest.mark.parametrize(("raw", "normalized"), GOLDEN["workspace_path"]["accepted"])
def test_workspace_path_accepted(raw: str, normalized: str) -> None:
    assert validate_workspace_path(raw) == normalized


@pytest.mark.parametrize("raw", GOLDEN["workspace_path"]["rejected"])
def test_workspace_path_rejected(raw: str) -> None:
    with pytest.raises(ProtocolError, match="path"):
        validate_workspace_path(raw)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", "o"), "storage_session"),
        (("s", ""), "object_id"),
        (("s\x00", "o"), "storage_session"),
        (("s", "o\x00"), "object_id"),
    ],
)
def test_input_cache_key_rejects_empty_and_nul(args: tuple[str, str], field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        input_cache_key(*args)


@pytest.mark.parametrize(
    "args",
    [
        ("", "u", "h"),
        ("n", "", "h"),
        ("n\x00", "u", "h"),
        ("n", "u", "bad hint"),
        ("n", "u", "x" * 129),
        ("n", "u", ""),
    ],
)
def test_runtime_session_id_rejects(args: tuple[str, str, str]) -> None:
    with pytest.raises(ProtocolError):
        runtime_session_id(*args)


@pytest.mark.parametrize("user_id", GOLDEN["user_id_accepted"])
def test_user_id_accepted_golden(user_id: str) -> None:
    """One rule, three checks: the function, the derivation and ``ExecCall``'s field."""
    assert validate_user_id(user_id) == user_id
    assert is_runtime_session_id(runtime_session_id("n", user_id, "h"))
    call = {"language": "python", "code": "1", "user_id": user_id}
    assert decode(json.dumps(call).encode(), ExecCall).user_id == user_id


@pytest.mark.parametrize("user_id", GOLDEN["user_id_rejected"])
def test_user_id_rejected_golden(user_id: str) -> None:
    with pytest.raises(ProtocolError, match="user_id"):
        validate_user_id(user_id)
    with pytest.raises(ProtocolError, match="user_id"):
        runtime_session_id("n", user_id, "h")
    call = {"language": "python", "code": "1", "user_id": user_id}
    with pytest.raises(ProtocolError, match="user_id"):
        decode(json.dumps(call).encode(), ExecCall)


@pytest.mark.parametrize(
    "value", ["rt_" + "a" * 63, "rt_" + "A" * 64, "xx_" + "a" * 64, "rt_" + "a" * 64 + "\n"]
)
def test_is_runtime_session_id_rejects(value: str) -> None:
    assert not is_runtime_session_id(value)
    with pytest.raises(ProtocolError):
        checkpoint_key(value, 1)
    with pytest.raises(ProtocolError):
        legacy_checkpoint_key(value)


@pytest.mark.parametrize("value", GOLDEN["input_ref"]["accepted"], ids=repr)
def test_input_ref_accepted_golden(value: str) -> None:
    """Either part may be any accepted value; the wire type agrees with the function."""
    assert validate_input_ref(value, value) == (value, value)
    ref = decode(json.dumps({"storage_session": value, "object_id": value, "name": "f"}), FileRef)
    assert (ref.storage_session, ref.object_id) == (value, value)


@pytest.mark.parametrize("value", GOLDEN["input_ref"]["rejected"], ids=repr)
def test_input_ref_rejected_golden(value: str) -> None:
    """Refused in either part, by the function and by the wire type, without echoing it."""
    with pytest.raises(ProtocolError, match="storage_session") as refused:
        validate_input_ref(value, "obj-1")
    if len(value) > 2:
        assert value not in str(refused.value)
    with pytest.raises(ProtocolError, match="object_id"):
        validate_input_ref("sess-A", value)
    for field in ("storage_session", "object_id"):
        body = {"storage_session": "sess-A", "object_id": "obj-1", "name": "f", field: value}
        with pytest.raises(ProtocolError, match=field):
            decode(json.dumps(body), FileRef)


@pytest.mark.parametrize("vector", GOLDEN["scoped_storage_session"])
def test_scoped_storage_session_golden(vector: dict[str, str]) -> None:
    """The scoped form is itself a valid wire part, and the namespace's tag prefixes it."""
    scoped = scoped_storage_session(vector["namespace"], vector["storage_session"])
    assert scoped == vector["scoped"]
    validate_input_ref(scoped, "obj-1")
    tag = hashlib.sha256(vector["namespace"].encode()).hexdigest()[:30]
    assert scoped == f"t{tag}.{vector['storage_session']}"


def test_scoped_storage_sessions_of_two_namespaces_never_meet() -> None:
    """A caller writing another namespace's scoped value still gets its own prefix."""
    a, b = GOLDEN["scoped_storage_session"][:2]
    assert a["storage_session"] == b["storage_session"]
    assert a["scoped"] != b["scoped"]
    assert scoped_storage_session(b["namespace"], a["scoped"]) != a["scoped"]


@pytest.mark.parametrize("vector", GOLDEN["scoped_storage_session_rejected"])
def test_scoped_storage_session_rejected_golden(vector: dict[str, str]) -> None:
    with pytest.raises(ProtocolError):
        scoped_storage_session(vector["namespace"], vector["storage_session"])


@pytest.mark.parametrize("vector", GOLDEN["escaped_name"])
def test_escaped_name_golden(vector: dict[str, str]) -> None:
    """A job's file name travels as the golden wire name, and comes back as its bytes."""
    raw = bytes.fromhex(vector["raw_hex"])
    assert escape_name(raw) == vector["name"]
    assert unescape_name(vector["name"]) == raw
    assert is_escaped_name(vector["name"]) == ("\\" in vector["name"])


@pytest.mark.parametrize("name", GOLDEN["escaped_name_rejected"])
def test_escaped_name_rejected(name: str) -> None:
    with pytest.raises(ProtocolError, match="name"):
        unescape_name(name)


def test_an_escaped_name_is_never_a_workspace_path() -> None:
    """The escaped form always holds a backslash, which paths refuse: never addressable."""
    for vector in GOLDEN["escaped_name"]:
        if is_escaped_name(vector["name"]):
            with pytest.raises(ProtocolError):
                validate_workspace_path(vector["name"])


@pytest.mark.parametrize("vector", GOLDEN["redacted_text"])
def test_redacted_text_golden(vector: dict[str, Any]) -> None:
    """Credentials in URLs, bearer tokens and the given secrets become [redacted]."""
    assert redact_secrets(vector["text"], secrets=vector["secrets"]) == vector["redacted"]
    # Idempotent: a redacted text redacts to itself.
    assert redact_secrets(vector["redacted"], secrets=vector["secrets"]) == vector["redacted"]
