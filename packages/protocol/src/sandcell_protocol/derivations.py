"""Values both peers compute. The golden vectors in tests/protocol/golden.json pin them."""

from __future__ import annotations

import hashlib
import posixpath
import re

from .errors import ProtocolError

_HINT_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_USER_ID_CHARS = 128
"""As a session hint: a user id is half of what a runtime session id is derived from."""
USER_ID_PATTERN = rf"^[^\x00-\x1f\x7f-\x9f]{{1,{MAX_USER_ID_CHARS}}}(?![\s\S])"
"""A caller's user id (``/v1/exec``'s ``user_id``, LibreChat's user): 1 to 128 characters,
none of them a control character. It is derived into runtime session ids, kept in the
session index and beside output files, and shown in listings and logs."""
USER_ID_RULE = f"1 to {MAX_USER_ID_CHARS} characters, no control characters"
"""``USER_ID_PATTERN`` as error messages say it."""
_USER_ID_RE = re.compile(USER_ID_PATTERN)
_RUNTIME_SESSION_RE = re.compile(r"^rt_[0-9a-f]{64}$")
_CACHE_KEY_RE = re.compile(r"^[0-9a-f]{64}$")

MAX_PATH_BYTES = 4096
MAX_COMPONENT_BYTES = 255


def _require_part(field: str, value: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{field}: must be a non-empty string")
    if "\x00" in value:
        raise ProtocolError(f"{field}: must not contain NUL")
    return value.encode("utf-8")


def input_cache_key(storage_session: str, object_id: str) -> str:
    """Key of an object in the runner's input cache.

    NUL-joined so that ``("a b", "c")`` and ``("a", "b c")`` can never collide.
    """
    joined = (
        _require_part("storage_session", storage_session)
        + b"\x00"
        + _require_part("object_id", object_id)
    )
    return hashlib.sha256(joined).hexdigest()


def is_input_cache_key(value: str) -> bool:
    """True for a string shaped like ``input_cache_key``'s output."""
    return bool(_CACHE_KEY_RE.fullmatch(value))


def validate_hint(hint: str) -> str:
    """Return ``hint`` if it is a valid runtime-session hint, else ``ProtocolError``."""
    if not isinstance(hint, str) or not _HINT_RE.fullmatch(hint):
        raise ProtocolError("hint: must match ^[A-Za-z0-9._:-]{1,128}$")
    return hint


def validate_user_id(user_id: str, *, field: str = "user_id") -> str:
    """Return ``user_id`` if it is a valid user id (``USER_ID_PATTERN``), else
    ``ProtocolError`` naming ``field``."""
    if not isinstance(user_id, str) or not _USER_ID_RE.match(user_id):
        raise ProtocolError(f"{field}: must be {USER_ID_RULE}")
    return user_id


def runtime_session_id(namespace: str, user_id: str, hint: str) -> str:
    """Tenant-scoped session id: the same hint from two tenants never collides."""
    validate_hint(hint)
    validate_user_id(user_id)
    joined = (
        _require_part("namespace", namespace)
        + b"\x00"
        + _require_part("user_id", user_id)
        + b"\x00"
        + _require_part("hint", hint)
    )
    return "rt_" + hashlib.sha256(joined).hexdigest()


def is_runtime_session_id(value: str) -> bool:
    """True for ``rt_`` followed by 64 lowercase hex digits."""
    return isinstance(value, str) and bool(_RUNTIME_SESSION_RE.fullmatch(value))


CHECKPOINTS_PREFIX = "checkpoints/"
CHECKPOINT_GENERATION_DIGITS = 20
"""Zero-padded to this width, so keys sort as their generations do (2**64 fits)."""
_GENERATION_RE = re.compile(rf"^[0-9]{{{CHECKPOINT_GENERATION_DIGITS}}}$")


def _require_session(runtime_session_id: str) -> str:
    if not is_runtime_session_id(runtime_session_id):
        raise ProtocolError("runtime_session_id: must match ^rt_[0-9a-f]{64}$")
    return runtime_session_id


def checkpoint_prefix(runtime_session_id: str) -> str:
    """Where every checkpoint object of a session lives: ``checkpoints/<rt>/``."""
    return f"{CHECKPOINTS_PREFIX}{_require_session(runtime_session_id)}/"


def checkpoint_key(runtime_session_id: str, generation: int) -> str:
    """Object-store key of the checkpoint written by a session's holder of ``generation``.

    ``checkpoints/<rt>/<generation, 20 digits>``. Each key is written once (a
    holder's generation is its own), so an object is never replaced: a stale
    holder's late upload lands under its own, older key, which no fenced
    registry record points at. The name says what the object is, not how its
    body is encoded (the encoding is sniffed from the body). Keys of one session
    sort by generation, and ``parse_checkpoint_key`` reads the generation back,
    so the latest checkpoint can be found from the store alone.
    """
    _require_session(runtime_session_id)
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise ProtocolError("generation: must be an integer >= 1")
    if generation >= 10**CHECKPOINT_GENERATION_DIGITS:
        raise ProtocolError(f"generation: must have at most {CHECKPOINT_GENERATION_DIGITS} digits")
    return f"{checkpoint_prefix(runtime_session_id)}{generation:0{CHECKPOINT_GENERATION_DIGITS}d}"


def parse_checkpoint_key(key: str) -> tuple[str, int] | None:
    """``(runtime_session_id, generation)`` of a ``checkpoint_key``; ``None`` for any other key."""
    if not isinstance(key, str) or not key.startswith(CHECKPOINTS_PREFIX):
        return None
    session, sep, generation = key[len(CHECKPOINTS_PREFIX) :].partition("/")
    if not sep or not is_runtime_session_id(session) or not _GENERATION_RE.fullmatch(generation):
        return None
    number = int(generation)
    return (session, number) if number >= 1 else None


def legacy_checkpoint_key(runtime_session_id: str) -> str:
    """The one mutable key a session's checkpoint had before generations: read, never written.

    ``checkpoints/<rt>.tar.gz`` (its body was zstd by default despite the name).
    A session saved by an older orchestrator is restored from it until its next
    checkpoint, which goes under ``checkpoint_key``.
    """
    return f"{CHECKPOINTS_PREFIX}{_require_session(runtime_session_id)}.tar.gz"


def validate_workspace_path(name: str) -> str:
    """Normalize a relative POSIX workspace path or raise ``ProtocolError``.

    Rejects empty, absolute, ``..`` components, NUL, backslash, a component over
    255 bytes and a path over 4096 bytes. ``a//b/./c`` becomes ``a/b/c``.
    """
    if not isinstance(name, str) or not name:
        raise ProtocolError("path: must be a non-empty string")
    if "\x00" in name:
        raise ProtocolError("path: must not contain NUL")
    if "\\" in name:
        raise ProtocolError("path: must not contain a backslash")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError("path: must be valid UTF-8") from exc
    if len(encoded) > MAX_PATH_BYTES:
        raise ProtocolError(f"path: longer than {MAX_PATH_BYTES} bytes")
    if name.startswith("/"):
        raise ProtocolError("path: must be relative")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if not parts:
        raise ProtocolError("path: names no file")
    for part in parts:
        if part == "..":
            raise ProtocolError("path: must not contain '..'")
        if len(part.encode("utf-8")) > MAX_COMPONENT_BYTES:
            raise ProtocolError(f"path: a component is longer than {MAX_COMPONENT_BYTES} bytes")
    normalized = "/".join(parts)
    # Belt and braces: the join above cannot escape, and posixpath agrees.
    if posixpath.normpath(normalized) != normalized:
        raise ProtocolError("path: does not normalize")
    return normalized
