"""Serve an ASGI app under a real uvicorn on a free loopback port, for a test's duration."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import uvicorn

from tests.fixtures.runner_process import free_port


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any,
    *,
    lifespan: Literal["auto", "on", "off"] = "off",
    port: int | None = None,
    tls: tuple[Path, Path] | None = None,
) -> AsyncIterator[str]:
    """Yield the base URL (``http(s)://127.0.0.1:PORT``) while ``app`` serves there.

    ``tls``: ``(certfile, keyfile)`` to serve HTTPS.
    """
    port = port or free_port()
    certfile, keyfile = (str(tls[0]), str(tls[1])) if tls is not None else (None, None)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        lifespan=lifespan,
        log_config=None,
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(1000):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        if task.done():
            task.result()
            raise RuntimeError("uvicorn exited during start-up")
        if not server.started:
            raise RuntimeError("uvicorn did not start")
        yield f"{'https' if tls is not None else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=30)
