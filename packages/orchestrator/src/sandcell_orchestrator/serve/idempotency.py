"""Idempotent retries: ``Idempotency-Key`` on the routes that run something.

A client that lost an answer (a timeout, a dropped connection, a worker that
died behind the load balancer) retries with the same ``Idempotency-Key`` and
gets the first run's answer, never a second run:

    first request          claims the key in the registry, runs, stores its
                           2xx answer (status + body) for ``result_ttl_s``
    same key, same body    that stored answer, byte for byte, with
                           ``Idempotent-Replayed: true``
    same key, other body   422 ``idempotency_key_reused``
    while the first runs   409 ``idempotency_in_flight`` with ``Retry-After``

Keys are scoped: the stored key is a hash of (surface, tenant, header value),
so two tenants' equal keys never meet, and what a client sends never becomes
a storage key itself. The claim lives in the registry (Redis in production),
so a retry that reaches another worker sees it too. A pending claim expires
``claim_ttl_s`` after its worker stopped renewing it (the worker died): a retry
after that runs again, since nothing was answered. An error answer is not
kept: the claim is dropped and a retry runs again (an error means the turn was
not acknowledged; the session kept the state of its last completed turn).

A registry can forget (a Redis wiped, or restarted without persistence). A keyed
session turn then finds itself applied in the snapshot store (``sessions/turn.py``).
A keyed *stateless* run (``claim(stateless=True)``: no session, nothing restored)
keeps its answer there itself: after its run, before it answers, the answer (with
the body's fingerprint) goes to ``answers/<stored key>`` (``StatelessAnswers``, in
``sessions/stateless_answers.py``, keeps those objects), and a claim that finds no
entry in the registry reads that object first: found, it is the replay (and the
registry's answer again); missing, the call is a first one and runs. The cost: one
store PUT per keyed stateless run, one GET per first keyed stateless call. A retry
that arrives while the first still runs after a wipe finds neither a claim nor an
object, and runs too. What a store failure means is decided here: a read that
fails fails the claim (retryable), a save that fails is only logged.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from starlette.requests import Request
from starlette.responses import Response

from sandcell_protocol import ErrorCode, ProtocolError, encode, error_body

from ..errors import CheckpointError, RegistryError, SandboxUnavailableError
from ..registry import SessionRegistry
from ..sessions.stateless_answers import StatelessAnswer, StatelessAnswers
from .errors import JSON_MEDIA_TYPE
from .idempotency_claim import Claim, drop_claim

__all__ = [
    "IDEMPOTENCY_KEY_HEADER",
    "IN_FLIGHT_RETRY_AFTER_S",
    "REPLAYED_HEADER",
    "Idempotency",
    "Claim",
    "IdempotencyConflict",
    "Replay",
    "idempotency_key",
    "replayed",
]

log = logging.getLogger(__name__)

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
# Printable ASCII without spaces: UUIDs, ULIDs and E2B's [a-z0-9-] keys all fit.
_KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")
IN_FLIGHT_RETRY_AFTER_S = 1
_STORE_TIMEOUT_S = 30.0
"""How long a keyed stateless claim waits for the store to read or save its answer."""


def idempotency_key(request: Request) -> str | None:
    """The request's ``Idempotency-Key``; ``ProtocolError`` (400) if it is malformed."""
    value = request.headers.get(IDEMPOTENCY_KEY_HEADER)
    if value is None:
        return None
    if not _KEY_RE.fullmatch(value):
        raise ProtocolError(f"{IDEMPOTENCY_KEY_HEADER}: 1-255 printable ASCII characters")
    return value


@dataclass(frozen=True, slots=True)
class IdempotencyConflict:
    """Why a keyed request was not run: its HTTP status, code and message."""

    status: int
    code: ErrorCode
    message: str

    def response(self) -> Response:
        headers = {"Retry-After": str(IN_FLIGHT_RETRY_AFTER_S)} if self.status == 409 else None
        return Response(
            encode(error_body(self.code, self.message, retryable=self.status == 409)),
            status_code=self.status,
            media_type=JSON_MEDIA_TYPE,
            headers=headers,
        )


@dataclass(frozen=True, slots=True)
class Replay:
    """A stored answer."""

    status: int
    body: bytes


Answer = Callable[[], Awaitable[Response]]


class Idempotency:
    """Runs keyed requests once per (surface, tenant, key), on a registry's entries."""

    def __init__(
        self,
        registry: Callable[[], SessionRegistry],
        *,
        result_ttl_s: float = 24 * 3600,
        claim_ttl_s: float = 30,
        answers: Callable[[], StatelessAnswers] | None = None,
    ) -> None:
        self._registry = registry
        self._result_ttl_ms = int(result_ttl_s * 1000)
        self._claim_ttl_ms = int(claim_ttl_s * 1000)
        self._answers = answers
        """Where keyed stateless runs keep a copy of their answers (None: only in the
        registry)."""

    @staticmethod
    def scoped(surface: str, namespace: str, key: str) -> str:
        """The stored key: a hash, so nothing a client sends becomes a storage key."""
        return hashlib.sha256(f"{surface}\0{namespace}\0{key}".encode()).hexdigest()

    async def claim(
        self,
        *,
        surface: str,
        namespace: str,
        key: str | None,
        body: bytes,
        stateless: bool = False,
    ) -> Claim | IdempotencyConflict | Replay:
        """Claim ``key`` for this request, or say why not (a conflict, or the stored answer).

        ``body`` is what must match for a replay: the request's bytes, or a
        canonical encoding of what was decoded from them. ``stateless``: the request
        runs in no session, so its answer is also kept in the snapshot store (see the
        module's docstring); a store that cannot say whether it has one fails the
        claim (retryable) rather than run the request a second time.
        """
        if key is None:
            return Claim(None, "", "", claim_ttl_ms=1, result_ttl_ms=1)
        stored_key = self.scoped(surface, namespace, key)
        fingerprint = hashlib.sha256(body).hexdigest()
        token = secrets.token_hex(16)
        registry = self._registry()
        held = await registry.claim_idempotency(
            stored_key, fingerprint=fingerprint, token=token, ttl_ms=self._claim_ttl_ms
        )
        if held is None:
            answers = self._answers() if stateless and self._answers else None
            save = None
            if answers is not None:
                saved = await _read_saved(registry, answers, stored_key, token)
                if saved is not None:
                    return await self._replay_saved(registry, saved, stored_key, token, fingerprint)
                save = functools.partial(_save_copy, answers, stored_key, fingerprint)
            return Claim(
                registry,
                stored_key,
                token,
                claim_ttl_ms=self._claim_ttl_ms,
                result_ttl_ms=self._result_ttl_ms,
                save=save,
            )
        if held.fingerprint != fingerprint:
            return _reused()
        if not held.done:
            return IdempotencyConflict(
                409,
                ErrorCode.IDEMPOTENCY_IN_FLIGHT,
                f"the first request with this {IDEMPOTENCY_KEY_HEADER} is still running",
            )
        return Replay(status=held.status, body=held.body)

    async def _replay_saved(
        self,
        registry: SessionRegistry,
        found: StatelessAnswer,
        stored_key: str,
        token: str,
        fingerprint: str,
    ) -> IdempotencyConflict | Replay:
        """A saved stateless answer, found by a claim the registry had forgotten: the
        replay, and the registry's answer again (the next retry reads it there)."""
        if found.fingerprint != fingerprint:
            await drop_claim(registry, stored_key, token)
            return _reused()
        try:
            await registry.finish_idempotency(
                stored_key,
                token=token,
                status=found.status,
                body=found.body,
                ttl_ms=self._result_ttl_ms,
            )
        except RegistryError as exc:
            log.warning("could not store an idempotent answer found in the store: %s", exc)
        return Replay(status=found.status, body=found.body)

    async def once(
        self, *, surface: str, namespace: str, key: str | None, body: bytes, answer: Answer
    ) -> Response:
        """``answer()`` once per key: a retry gets the stored 2xx JSON answer.

        A non-2xx answer is not kept (the claim is dropped; a retry runs again).
        """
        claim = await self.claim(surface=surface, namespace=namespace, key=key, body=body)
        if isinstance(claim, IdempotencyConflict):
            return claim.response()
        if isinstance(claim, Replay):
            return replayed(
                Response(claim.body, status_code=claim.status, media_type=JSON_MEDIA_TYPE)
            )

        async def kept() -> Response:
            response = await answer()
            content = getattr(response, "body", None)
            if not (200 <= response.status_code < 300 and isinstance(content, bytes)):
                raise _NotKept(response)
            return response

        try:
            return await claim.kept(kept(), stored=_stored)
        except _NotKept as not_kept:
            return not_kept.response


def _reused() -> IdempotencyConflict:
    return IdempotencyConflict(
        422,
        ErrorCode.IDEMPOTENCY_KEY_REUSED,
        f"{IDEMPOTENCY_KEY_HEADER} was used for a request with another body",
    )


async def _read_saved(
    registry: SessionRegistry, answers: StatelessAnswers, stored_key: str, token: str
) -> StatelessAnswer | None:
    """The stateless answer the store keeps for ``stored_key`` (None: a first call).

    A store that cannot say fails the claim (dropped, retryable) rather than run the
    request a second time."""
    try:
        with anyio.fail_after(_STORE_TIMEOUT_S):
            return await answers.read_result(stored_key)
    except (CheckpointError, TimeoutError) as exc:
        await drop_claim(registry, stored_key, token)
        raise SandboxUnavailableError(
            f"cannot read a keyed run's saved answer ({type(exc).__name__}); retry"
        ) from exc


async def _save_copy(
    answers: StatelessAnswers, stored_key: str, fingerprint: str, status: int, body: bytes
) -> None:
    """Keep a keyed stateless run's answer in the store. Best effort: the registry has
    it too, and only a registry that forgot it would need this copy."""
    answer = StatelessAnswer(fingerprint=fingerprint, status=status, body=body)
    try:
        with anyio.fail_after(_STORE_TIMEOUT_S):
            await answers.put_result(stored_key, answer)
    except (CheckpointError, TimeoutError) as exc:
        log.warning("a keyed stateless answer not saved in the store: %s", type(exc).__name__)


class _NotKept(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__("not kept")
        self.response = response


def _stored(response: Response) -> tuple[int, bytes]:
    return response.status_code, bytes(response.body)


def replayed(response: Response) -> Response:
    """Mark ``response`` as a stored answer replayed."""
    response.headers[REPLAYED_HEADER] = "true"
    return response
