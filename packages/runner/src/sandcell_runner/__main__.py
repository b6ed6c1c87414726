"""``sandcell-runner`` (or ``python -m sandcell_runner``): serve the runner with uvicorn.

Only the standard library and ``runner_token`` are imported before ``main`` has
moved a token out of the environment (which may exec this program again), so
that re-exec costs one interpreter start, not the runner's imports twice.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from . import runner_token

log = logging.getLogger("sandcell_runner")


def main() -> int:
    try:
        # Returns only when the environment holds no token (else: exec, same pid).
        runner_token.reexec_without_token_variable(os.environ, sys.argv)
    except runner_token.TokenSourceError as exc:
        sys.stderr.write(f"sandcell-runner: configuration error: {exc}\n")
        return 2
    # Before the token is read: from here on /proc/<pid>/mem and environ need CAP_SYS_PTRACE.
    undumpable = runner_token.make_undumpable()
    return _serve(undumpable=undumpable)


def _serve(*, undumpable: bool) -> int:
    import uvicorn

    from .config import RunnerSettings
    from .errors import ConfigError
    from .host import raise_nofile_limit
    from .http.app import create_app
    from .http.coalescing import CoalescingHttpToolsProtocol
    from .service import RunnerService

    try:
        settings = RunnerSettings.from_env(os.environ, read_token_file=runner_token.take_token_file)
        # First: made non-inheritable before any helper or job process is forked.
        listener = _inherited_listener(settings.listen_fd) if settings.listen_fd else None
    except ConfigError as exc:
        sys.stderr.write(f"sandcell-runner: configuration error: {exc}\n")
        return 2
    # No child (nsjail, the warmup command) inherits either variable.
    runner_token.scrub_environment(os.environ)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    soft, hard = raise_nofile_limit()
    log.info("RLIMIT_NOFILE soft=%s hard=%s", soft, hard)
    if not undumpable:
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed: the runner's /proc files stay readable")
    try:
        service = RunnerService(settings)
    except ConfigError as exc:
        sys.stderr.write(f"sandcell-runner: configuration error: {exc}\n")
        return 2
    log.info(
        "languages: %s",
        ", ".join(service.languages) or "none",
    )
    config = uvicorn.Config(
        create_app(service),
        host=settings.host,
        port=settings.port,
        # uvloop (when installed): 3-15% less runner CPU per request (bench_runner
        # A/B). Its child spawning is a fork (~2.5 ms at the runner's RSS): jobs never
        # use it (the spawn helper forks them), the restore extractor and the apps'
        # log filters do. httptools parses faster than h11; its protocol here sends
        # a response's head and body as one write (``http/coalescing.py``).
        loop=settings.event_loop,
        http=CoalescingHttpToolsProtocol,
        # The runner never uses the client's address; X-Forwarded-* parsing is
        # per-request work (and trust) with nothing to gain.
        proxy_headers=False,
        lifespan="on",
        access_log=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
    )
    # After Config, which configures uvicorn's loggers: a filter on the logger itself
    # holds whatever handlers they get.
    logging.getLogger("uvicorn.error").addFilter(QuietHandshakes())
    server = uvicorn.Server(config)
    server.run(sockets=[listener] if listener is not None else None)
    return 0


class QuietHandshakes(logging.Filter):
    """Drops the handshake lines websockets logs at DEBUG on uvicorn's error logger.

    uvicorn's WebSocket protocol hands its logger to the websockets library, which logs
    an upgrade's request line and every header (``< authorization: Bearer <token>``)
    and each frame as ``< …`` / ``> …``; at ``SANDCELL_RUNNER_LOG_LEVEL=debug`` every
    relayed preview WebSocket wrote the runner's token into its log.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(("< ", "> ")))


def _inherited_listener(fd: int) -> socket.socket:
    """The launcher's listening socket: connections queued before start-up are served.

    A launcher that binds the socket itself has no port to race for, and its first
    request waits in the backlog instead of polling until the runner listens.
    """
    from .errors import ConfigError

    try:
        listener = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError(
            f"SANDCELL_RUNNER_LISTEN_FD: {fd} is not a socket ({exc.strerror})"
        ) from None
    if listener.type != socket.SOCK_STREAM or not listener.getsockopt(
        socket.SOL_SOCKET, socket.SO_ACCEPTCONN
    ):
        listener.detach()
        raise ConfigError(f"SANDCELL_RUNNER_LISTEN_FD: {fd} is not a listening stream socket")
    listener.set_inheritable(False)  # no job or helper inherits the runner's listener
    return listener


if __name__ == "__main__":
    raise SystemExit(main())
