"""A keyed request's hold on its ``Idempotency-Key`` (``Claim``): the claim protocol.

``Idempotency.claim`` (``idempotency.py``) decides whether a request runs; when it
does, its ``Claim`` renews the registry's pending entry while the work runs
(every third of ``claim_ttl_ms``), then stores the work's answer for
``result_ttl_ms`` or, when the work failed, drops the entry so that a retry runs
again. A commit that stores the answer itself (``answering``) makes the turn and
its answer one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from ..errors import RegistryError
from ..registry import IdempotentAnswer, SessionRegistry

__all__ = ["Claim", "Save", "drop_claim"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Save = Callable[[int, bytes], Awaitable[None]]


class Claim:
    """This request's hold on its key: renewed while the work runs, then answered or dropped.

    A request without a key gets a ``Claim`` that keeps nothing.
    """

    def __init__(
        self,
        registry: SessionRegistry | None,
        key: str,
        token: str,
        *,
        claim_ttl_ms: int,
        result_ttl_ms: int,
        save: Save | None = None,
    ) -> None:
        self._registry = registry
        self._key = key
        self._token = token
        self._claim_ttl_ms = claim_ttl_ms
        self._result_ttl_ms = result_ttl_ms
        self._save = save

    @property
    def key(self) -> str | None:
        """The stored key this request claimed (a hash); None without a key."""
        return self._key if self._registry is not None else None

    def answering(
        self, stored: Callable[[T], tuple[int, bytes] | None]
    ) -> Callable[[T], IdempotentAnswer | None] | None:
        """What a session turn's committing write stores as this key's answer, for its
        result (``stored(result)``: status, body; None: nothing to keep for it, as for
        a result its surface answers as an error); None without a key.

        With it the record write that commits a turn also stores its answer (one
        atomic write), so a worker dying right after that write leaves a committed
        turn whose retry gets the answer instead of running it again.
        """
        if self._registry is None:
            return None

        def answer(result: T) -> IdempotentAnswer | None:
            kept = stored(result)
            if kept is None:
                return None
            status, body = kept
            return IdempotentAnswer(
                key=self._key,
                token=self._token,
                status=status,
                body=body,
                ttl_ms=self._result_ttl_ms,
            )

        return answer

    async def kept(
        self,
        work: Awaitable[T],
        *,
        stored: Callable[[T], tuple[int, bytes]],
        unanswered: Callable[[], Awaitable[None]] | None = None,
    ) -> T:
        """Await ``work``; store ``stored(result)`` (status, body) as the key's answer.

        If ``work`` raises (or is cancelled) the claim is dropped: a retry runs again.
        The answer is stored here even if ``work``'s commit stored it already
        (``answering``): the same bytes again, and the one store for work that
        commits nothing (a stateless run) or whose commit could not be written.

        ``unanswered`` is awaited (shielded, its own failure only logged) when ``work``
        failed and no answer of this request is kept: what ``work`` stored for an
        answer (output files) is then named by none. A key whose answer a commit
        stored before the failure, or whose claim could not be dropped, keeps it.
        """
        registry = self._registry
        if registry is None:
            try:
                return await work
            except BaseException:
                if unanswered is not None:
                    await _unanswered(unanswered)
                raise
        renewer = asyncio.create_task(self._renew(registry))
        try:
            result = await work
        except BaseException:
            renewer.cancel()
            if await self._drop(registry) and unanswered is not None:
                await _unanswered(unanswered)
            raise
        renewer.cancel()
        status, body = stored(result)
        if self._save is not None:
            # A stateless run's only copy outside the registry, saved before it answers.
            await self._save(status, body)
        try:
            await registry.finish_idempotency(
                self._key, token=self._token, status=status, body=body, ttl_ms=self._result_ttl_ms
            )
        except RegistryError as exc:
            # The answer is the caller's either way; a retry may then run again.
            log.warning("could not store an idempotent answer: %s", exc)
        return result

    async def _renew(self, registry: SessionRegistry) -> None:
        ttl_ms = self._claim_ttl_ms
        while True:
            await asyncio.sleep(ttl_ms / 3000)
            try:
                if not await registry.renew_idempotency(
                    self._key, token=self._token, ttl_ms=ttl_ms
                ):
                    return
            except RegistryError as exc:
                log.warning("could not renew an idempotency claim: %s", exc)

    async def _drop(self, registry: SessionRegistry) -> bool:
        """Drop the pending claim; whether it was (False: answered, not ours, or unknown)."""
        return await drop_claim(registry, self._key, self._token)


async def _unanswered(clean_up: Callable[[], Awaitable[None]]) -> None:
    # Shielded: a client that left must not leave what its run stored behind.
    with anyio.CancelScope(shield=True):
        try:
            await clean_up()
        except Exception as exc:
            log.warning("could not remove what an unanswered request stored: %s", exc)


async def drop_claim(registry: SessionRegistry, key: str, token: str) -> bool:
    """Drop the pending claim ``token`` holds on ``key`` (best effort, shielded);
    whether it was (False: answered, not ours, or unknown)."""
    with contextlib.suppress(RegistryError), anyio.CancelScope(shield=True):
        return await registry.drop_idempotency(key, token=token)
    return False
