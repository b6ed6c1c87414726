"""A webhook receiver for tests: a real HTTP endpoint that records what it was sent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Answers each POST with the next of ``statuses`` (then 204), recording every call."""

    statuses: list[int] = field(default_factory=list)
    calls: list[Received] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> Starlette:
        async def hook(request: Request) -> Response:
            self.calls.append(Received(dict(request.headers), await request.body()))
            self.arrived.set()
            status = self.statuses.pop(0) if self.statuses else 204
            return Response(status_code=status)

        return Starlette(routes=[Route("/hook", hook, methods=["POST"])])

    async def wait_for(self, count: int, *, timeout_s: float = 30) -> list[Received]:
        async with asyncio.timeout(timeout_s):
            while len(self.calls) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.calls
