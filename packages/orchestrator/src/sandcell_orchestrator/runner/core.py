"""``RunnerCore``: the ``RunnerClient`` plumbing its route mixins send through.

``RunnerTransfers`` and ``RunnerApps`` are mixins of ``RunnerClient``; their
methods are typed against this protocol (``self: RunnerCore``) so that each
module states what it uses of the client without importing it (which would
be circular). ``RunnerClient`` satisfies it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Protocol, TypeVar

import httpx

from .errors import Redactor

__all__ = ["RunnerCore"]

T = TypeVar("T")


class RunnerCore(Protocol):
    """What a route mixin may use of ``RunnerClient``; see the module docstring."""

    base_url: str
    _client: httpx.AsyncClient
    _redact: Redactor
    _transport_injected: bool

    async def _request(
        self,
        method: str,
        route: str,
        *,
        session_id: str | None = None,
        message: object = None,
        extra_headers: Mapping[str, str] | None = None,
        read_timeout_s: float | None = None,
        stream: bool = False,
        any_status: bool = False,
        **kwargs: object,
    ) -> httpx.Response: ...

    def _build_request(
        self,
        method: str,
        route: str,
        *,
        session_id: str | None = None,
        message: object = None,
        extra_headers: Mapping[str, str] | None = None,
        read_timeout_s: float | None = None,
        **kwargs: object,
    ) -> httpx.Request: ...

    async def _ensure_compatible(self) -> None: ...

    def _decode(self, response: httpx.Response, type_: type[T]) -> T: ...

    def _mapping(self, request: httpx.Request) -> contextlib.AbstractContextManager[None]: ...
