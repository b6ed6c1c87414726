"""Webhook delivery: signed POSTs, retried with backoff, off the request path.

``WebhookSender.submit`` only enqueues (it never awaits the network), so an API
request that discovers a new runtime error is never slowed by a receiver. A few
worker tasks drain the bounded queue; a full queue drops the newest delivery
with a warning rather than grow without bound.

Each body is signed with HMAC-SHA256 over the exact bytes sent::

    X-Sandcell-Signature: sha256=<hex hmac(secret, body)>
    X-Sandcell-Delivery:  <random id, the same on every retry of one delivery>

A receiver recomputes the HMAC over the raw body (``verify_signature``) before
parsing it. Transport failures, 429 and 5xx answers are retried after
``base_delay_s * 2**attempt`` (jittered, capped) up to ``max_attempts``; any
other answer ends the delivery; redirects are not followed (a 3xx ends it too).
The secret and the signature never reach a log.

Deliveries go only to public addresses, plus the networks the operator allowed
(``allow_nets``, from ``SANDCELL_APP_WEBHOOK_ALLOW_NETS``): ``check_url`` refuses
a URL up front, and every connection is made to an address vetted after
resolving (see ``webhook_targets``). A refused delivery is logged by its id and
host and is not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import random
import secrets
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import httpx

from sandcell_protocol import encode

from .webhook_targets import (
    IPNetwork,
    PinnedTransport,
    Resolver,
    WebhookTargetError,
    WebhookTargets,
    resolve_host,
)

__all__ = [
    "DELIVERY_HEADER",
    "SIGNATURE_HEADER",
    "Delivery",
    "WebhookSender",
    "sign",
    "verify_signature",
]

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Sandcell-Signature"
DELIVERY_HEADER = "X-Sandcell-Delivery"
_RETRY_STATUSES = frozenset({408, 425, 429})
_Outcome = Literal["ok", "retry", "final", "refused"]


def sign(secret: str, body: bytes) -> str:
    """The signature header value of ``body``: ``sha256=<hex>``."""
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify_signature(secret: str, body: bytes, header: str | None) -> bool:
    """True when ``header`` is ``body``'s signature under ``secret`` (constant time)."""
    if not header:
        return False
    return hmac.compare_digest(sign(secret, body).encode(), header.strip().encode())


@dataclass(frozen=True, slots=True)
class Delivery:
    """One webhook to send: where, and the JSON-encodable payload."""

    # A receiver's URL may carry its own token (chat-style incoming webhooks).
    url: str = field(repr=False)
    payload: object = field(repr=False)
    delivery_id: str = field(default_factory=lambda: secrets.token_hex(12))


class WebhookSender:
    """Queues and delivers signed webhooks in the background. ``async with`` for its workers.

    ``allow_nets`` are the networks webhooks may reach although not public (none by
    default). ``resolver`` and ``ssl_context`` are how hosts are looked up and TLS
    receivers verified. A ``transport`` replaces the connection vetting (only the
    ``check_url`` part stays): it is for tests that talk to an in-process app.
    """

    def __init__(
        self,
        *,
        secret: str,
        allow_nets: Iterable[IPNetwork] = (),
        resolver: Resolver = resolve_host,
        ssl_context: ssl.SSLContext | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_attempts: int = 6,
        base_delay_s: float = 0.5,
        max_delay_s: float = 30.0,
        timeout_s: float = 10.0,
        workers: int = 4,
        queue_size: int = 1000,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._secret = secret
        self.targets = WebhookTargets(tuple(allow_nets))
        self._max_attempts = max_attempts
        self._base_delay_s = base_delay_s
        self._max_delay_s = max_delay_s
        self._sleep = sleep
        self._jitter = jitter
        self._workers = workers
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue(maxsize=queue_size)
        self._tasks: list[asyncio.Task[None]] = []
        self._client = httpx.AsyncClient(
            transport=transport
            or PinnedTransport(self.targets, resolver=resolver, ssl_context=ssl_context),
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=False,
            trust_env=False,
        )
        self.delivered = 0
        self.failed = 0
        """Deliveries given up, refused ones included."""
        self.refused = 0
        """Deliveries not attempted because their destination is not allowed."""
        self.dropped = 0

    def __repr__(self) -> str:
        return f"WebhookSender(pending={self._queue.qsize()}, workers={len(self._tasks)})"

    async def __aenter__(self) -> WebhookSender:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def start(self) -> None:
        """Start the worker tasks (idempotent)."""
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._work(), name=f"sandcell-webhook-{index}")
                for index in range(self._workers)
            ]

    def check_url(self, url: str) -> None:
        """Refuse (``WebhookTargetError``, a ``bad_request``) a URL this sender won't send to.

        For accepting a ``webhook_url``: what the URL says is checked (a literal
        address, ``localhost``); where a name resolves is checked at delivery.
        """
        self.targets.check_url(url)

    def submit(self, delivery: Delivery) -> bool:
        """Enqueue ``delivery`` without waiting; False if the queue was full (dropped)."""
        try:
            self._queue.put_nowait(delivery)
        except asyncio.QueueFull:
            self.dropped += 1
            log.warning("webhook queue full: dropped delivery %s", delivery.delivery_id)
            return False
        return True

    async def drain(self) -> None:
        """Wait until every queued delivery has finished (delivered or given up)."""
        await self._queue.join()

    async def aclose(self) -> None:
        """Stop the workers (pending deliveries are abandoned) and close the client."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self._client.aclose()

    async def _work(self) -> None:
        while True:
            delivery = await self._queue.get()
            try:
                await self.deliver(delivery)
            except Exception:
                log.exception("webhook delivery %s failed unexpectedly", delivery.delivery_id)
            finally:
                self._queue.task_done()

    async def deliver(self, delivery: Delivery) -> bool:
        """Send one delivery now, retrying with backoff; True once a receiver accepted it."""
        body = encode(delivery.payload)
        request_headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign(self._secret, body),
            DELIVERY_HEADER: delivery.delivery_id,
        }
        for attempt in range(self._max_attempts):
            outcome = await self._attempt(delivery, body, request_headers)
            if outcome == "ok":
                self.delivered += 1
                return True
            if outcome == "refused":
                self.refused += 1
                break
            if outcome == "final" or attempt + 1 == self._max_attempts:
                break
            await self._sleep(self._delay_s(attempt))
        self.failed += 1
        log.warning("webhook delivery %s given up", delivery.delivery_id)
        return False

    async def _attempt(
        self, delivery: Delivery, body: bytes, request_headers: dict[str, str]
    ) -> _Outcome:
        try:
            # Checked on every delivery too: the URL may predate the check or the allow-list.
            self.targets.check_url(delivery.url)
            # Streamed and never read: only the status matters, and a receiver
            # answering with an endless body must not be buffered.
            async with self._client.stream(
                "POST",
                delivery.url,
                content=body,
                headers=request_headers,
                follow_redirects=False,
            ) as response:
                status = response.status_code
        except WebhookTargetError as exc:
            # The message names the host and address, never the URL's path or query.
            log.warning("webhook delivery %s refused: %s", delivery.delivery_id, exc)
            return "refused"
        except httpx.HTTPError as exc:
            log.info("webhook delivery %s: %s", delivery.delivery_id, type(exc).__name__)
            return "retry"
        if 200 <= status < 300:
            return "ok"
        log.info("webhook delivery %s: HTTP %d", delivery.delivery_id, status)
        if status >= 500 or status in _RETRY_STATUSES:
            return "retry"
        return "final"

    def _delay_s(self, attempt: int) -> float:
        delay = min(self._base_delay_s * (2.0**attempt), self._max_delay_s)
        # Full jitter on the upper half: receivers recovering from an outage are
        # not hit by every sender at the same instant.
        return delay / 2 + self._jitter() * delay / 2
