"""A feature's lifetime inside the serve app's: started after what the app opens."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.applications import Starlette

__all__ = ["run_in_lifespan"]


def run_in_lifespan(
    app: Starlette, running: Callable[[], AbstractAsyncContextManager[object]]
) -> None:
    """Enter ``running()`` inside ``app``'s lifespan, once what the lifespan already
    opens (the services a feature runs on) is open, and leave it before they close.

    ``running`` is called there, not now: the services it reads do not exist yet.
    """
    outer = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(target: Any) -> AsyncIterator[Any]:
        async with outer(target) as state, running():
            yield state

    app.router.lifespan_context = lifespan
