"""A create's ``Idempotency-Key``, claimed across the fleet: a retry on any worker
gets the sandbox the first create made.

The claim lives in the registry: renewed while the create runs (a dead worker's
lapses after ``CREATE_CLAIM_TTL_MS``), then the made sandbox's id is kept for a day.
A retry while the first create still runs waits for it; a key whose sandbox was
killed since makes one more, once, keyed on from the one it replaces.

A keyed create's sandbox id comes from its claimed key (``keyed_sandbox_id``), so
a worker that died after registering the sandbox but before storing the create's
answer leaves a row the retry finds: it answers that sandbox instead of making a
second one nobody would be told of. (Should that sandbox be killed before any
retry, the retry makes a new one under the same id.)
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Awaitable, Callable

import anyio

from ..registry import E2bSandboxRow, SessionRegistry
from ..serve.idempotency import Claim
from .errors import E2bError
from .sandbox import ID_ALPHABET, ID_CHARS, E2bSandbox, valid_sandbox_id

__all__ = ["check_create_key", "create_once", "keyed_sandbox_id"]

_KEY_RE = re.compile(r"[a-z0-9-]{1,255}")
CREATE_CLAIM_TTL_MS = 30_000
_CREATE_RESULT_TTL_MS = 24 * 3600 * 1000
_CREATE_WAIT_S = 60.0
_CREATE_POLL_S = 0.2


def check_create_key(key: str | None) -> str | None:
    """``key`` if it is a valid E2B ``Idempotency-Key`` (or None); else a 400."""
    if key is not None and not _KEY_RE.fullmatch(key):
        raise E2bError(400, "bad_request", "Idempotency-Key: 1-255 of [a-z0-9-]")
    return key


def keyed_sandbox_id(stored: str) -> str:
    """The id of the sandbox a create claimed as ``stored`` makes: 20 of [a-z0-9]."""
    number = int(hashlib.sha256(f"e2b/sandbox-id\0{stored}".encode()).hexdigest(), 16)
    digits = []
    for _ in range(ID_CHARS):
        number, digit = divmod(number, len(ID_ALPHABET))
        digits.append(ID_ALPHABET[digit])
    return "".join(digits)


async def create_once(
    registry: SessionRegistry,
    *,
    owner: str,
    key: str,
    make: Callable[[str], Awaitable[E2bSandbox]],
    view: Callable[[E2bSandboxRow], Awaitable[E2bSandbox]],
) -> E2bSandbox:
    """``make(sandbox_id)`` once per (tenant, key) across the fleet: a retry waits for
    a create still running elsewhere, then answers its sandbox (``view`` of its row);
    one whose first create died after registering its sandbox answers that one."""
    stored = hashlib.sha256(f"e2b/create\0{owner}\0{key}".encode()).hexdigest()
    token = secrets.token_hex(16)
    waited_until = time.monotonic() + _CREATE_WAIT_S
    while True:
        held = await registry.claim_idempotency(
            stored, fingerprint="e2b-create", token=token, ttl_ms=CREATE_CLAIM_TTL_MS
        )
        if held is None:
            break
        if held.done:
            made_id = held.body.decode(errors="replace")
            row = await registry.e2b_sandbox(made_id) if valid_sandbox_id(made_id) else None
            if row is not None and row.namespace == owner:
                return await view(row)
            # The first create's sandbox was killed since: the key makes one more,
            # once, keyed on from the one it replaces.
            stored = hashlib.sha256(f"{stored}\0{made_id}".encode()).hexdigest()
            continue
        if time.monotonic() > waited_until:
            raise E2bError(
                409, "idempotency_in_flight", "a create with this Idempotency-Key still runs"
            )
        await anyio.sleep(_CREATE_POLL_S)
    claim = Claim(
        registry,
        stored,
        token,
        claim_ttl_ms=CREATE_CLAIM_TTL_MS,
        result_ttl_ms=_CREATE_RESULT_TTL_MS,
    )
    sandbox_id = keyed_sandbox_id(stored)

    async def made_or_make() -> E2bSandbox:
        row = await registry.e2b_sandbox(sandbox_id)
        if row is not None and row.namespace == owner:
            return await view(row)  # made by a create whose answer was never stored
        return await make(sandbox_id)

    return await claim.kept(made_or_make(), stored=lambda made: (201, made.sandbox_id.encode()))
