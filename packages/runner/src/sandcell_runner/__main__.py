"""``sandcell-runner`` (or ``python -m sandcell_runner``): serve the runner with uvicorn."""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

from .config import RunnerSettings
from .errors import ConfigError
from .http.app import create_app
from .service import RunnerService, raise_nofile_limit

log = logging.getLogger("sandcell_runner")

# Variables holding secrets: removed from our own environment once read, so no
# child (nsjail, the warmup command) can inherit them.
_SECRET_VARIABLES = ("SANDCELL_RUNNER_TOKEN",)


def main() -> int:
    try:
        settings = RunnerSettings.from_env(os.environ)
    except ConfigError as exc:
        sys.stderr.write(f"sandcell-runner: configuration error: {exc}\n")
        return 2
    for name in _SECRET_VARIABLES:
        os.environ.pop(name, None)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    soft, hard = raise_nofile_limit()
    log.info("RLIMIT_NOFILE soft=%s hard=%s", soft, hard)
    try:
        service = RunnerService(settings)
    except ConfigError as exc:
        sys.stderr.write(f"sandcell-runner: configuration error: {exc}\n")
        return 2
    log.info(
        "languages: %s",
        ", ".join(f"{s.name} {s.version}" for s in service.languages.values()) or "none",
    )
    config = uvicorn.Config(
        create_app(service),
        host=settings.host,
        port=settings.port,
        # asyncio, not uvloop: uvloop's child spawning cost grows with the process's
        # RSS; httptools parses faster than h11.
        loop="asyncio",
        http="httptools",
        # The runner never uses the client's address; X-Forwarded-* parsing is
        # per-request work (and trust) with nothing to gain.
        proxy_headers=False,
        lifespan="on",
        access_log=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
