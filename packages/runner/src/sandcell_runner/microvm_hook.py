"""The Lambda MicroVM lifecycle-hook listener: ``python -m sandcell_runner.microvm_hook``.

A MicroVM image holds no secret, so the runner cannot start at boot: its token
arrives in the ``runHookPayload`` of ``RunMicrovm``, which the service delivers to
the image's ``/run`` hook (port 9000 by default). This listener answers ``/ready``
(image builds call it whenever any hook is enabled), and on ``/run`` validates
the payload ``{"sandcell": 1, "runner_token": "<64 hex>"}`` and starts
``sandcell-runner`` exactly once, handing it the token on a pipe
(``SANDCELL_RUNNER_TOKEN_FILE=/dev/fd/N``), never in an environment block. The
listener is non-dumpable too: it held the token. Other hooks (``/resume``,
``/suspend``, ``/terminate``) are acknowledged.

Standard library only (``http.server``): it runs before the runner and must not
pay the runner's import cost or share its process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .runner_token import TOKEN_FILE_VARIABLE, TOKEN_VARIABLE, make_undumpable

log = logging.getLogger("sandcell_runner.microvm_hook")

_TOKEN_RE = re.compile(r"[0-9a-f]{64}")
_MAX_PAYLOAD_BYTES = 64 * 1024
_ACKNOWLEDGED = ("/resume", "/suspend", "/terminate")
_HOOK_PREFIX = "/aws/lambda-microvms/runtime/v1"
CPU_MILLICORES_VARIABLE = "SANDCELL_RUNNER_CPU_MILLICORES"

RunnerLauncher = Callable[[str], subprocess.Popen[bytes]]


def parse_payload(body: bytes) -> str:
    """The runner token from a run-hook payload; ``ValueError`` naming what is wrong."""
    if len(body) > _MAX_PAYLOAD_BYTES:
        raise ValueError("payload too large")
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("payload is not JSON") from None
    # The service may wrap the payload; accept it bare or under "runHookPayload".
    if isinstance(payload, dict) and "runHookPayload" in payload:
        inner = payload["runHookPayload"]
        payload = json.loads(inner) if isinstance(inner, str) else inner
    if not isinstance(payload, dict) or payload.get("sandcell") != 1:
        raise ValueError("not a sandcell payload")
    token = payload.get("runner_token")
    if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
        raise ValueError("runner_token must be 64 lowercase hex digits")
    return token


def runner_environment(base: Mapping[str, str]) -> dict[str, str]:
    """The runner's environment: the image's, without any token, with the job CPU quota
    set to the VM's CPUs unless the image sets one.

    The runner's own default quota is one core, right for a runner sharing a host with
    others; in a MicroVM it is alone, and one core would leave the VM's other vCPUs idle
    while its jobs queue for the first (the Docker provider does the same from the
    container's CPUs).
    """
    child_env = {k: v for k, v in base.items() if k not in (TOKEN_VARIABLE, TOKEN_FILE_VARIABLE)}
    child_env.setdefault(CPU_MILLICORES_VARIABLE, str(len(os.sched_getaffinity(0)) * 1000))
    return child_env


def launch_runner(token: str, *, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start the runner with ``token`` on a pipe; its other settings come from the image's
    environment (``runner_environment``)."""
    child_env = runner_environment(env if env is not None else os.environ)
    read_fd, write_fd = os.pipe()
    try:
        try:
            os.write(write_fd, token.encode())  # 64 hex digits: far below a pipe's buffer
        finally:
            os.close(write_fd)
        child_env[TOKEN_FILE_VARIABLE] = f"/dev/fd/{read_fd}"
        return subprocess.Popen(
            [sys.executable, "-m", "sandcell_runner"],
            env=child_env,
            stdin=subprocess.DEVNULL,
            pass_fds=(read_fd,),
        )
    finally:
        os.close(read_fd)


class HookState:
    """The one runner this VM runs; started by the first valid ``/run``."""

    def __init__(self, launcher: RunnerLauncher) -> None:
        self._launcher = launcher
        self._lock = threading.Lock()
        self.runner: subprocess.Popen[bytes] | None = None

    def start(self, token: str) -> bool:
        """Start the runner; False when one is already running (a repeated hook)."""
        with self._lock:
            if self.runner is not None and self.runner.poll() is None:
                return False
            self.runner = self._launcher(token)
            return True


def make_handler(state: HookState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "sandcell-hook"

        def _answer(self, status: int, message: str) -> None:
            body = json.dumps({"message": message}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _hook(self) -> str:
            path = self.path.split("?", 1)[0]
            return path.removeprefix(_HOOK_PREFIX) or "/"

        def do_GET(self) -> None:
            if self._hook() == "/ready":
                self._answer(200, "ready")
            else:
                self._answer(404, "no such hook")

        def do_POST(self) -> None:
            hook = self._hook()
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_PAYLOAD_BYTES:
                self._answer(413, "payload too large")
                return
            body = self.rfile.read(length) if length else b""
            if hook == "/ready":
                self._answer(200, "ready")
            elif hook == "/run":
                try:
                    token = parse_payload(body)
                except ValueError as exc:
                    # The message names the problem, never the payload (it holds the token).
                    log.warning("run hook refused: %s", exc)
                    self._answer(400, str(exc))
                    return
                started = state.start(token)
                self._answer(200, "runner started" if started else "runner already running")
            elif hook in _ACKNOWLEDGED:
                self._answer(200, "ok")
            else:
                self._answer(404, "no such hook")

        def log_message(self, format: str, *args: object) -> None:
            log.info("hook %s", format % args)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MicroVM lifecycle-hook listener")
    parser.add_argument("--host", default="0.0.0.0")  # noqa: S104 - the VM's hook interface
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("SANDCELL_HOOK_PORT", "9000"))
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not make_undumpable():
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed: this listener's memory stays readable")
    state = HookState(lambda token: launch_runner(token))
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    log.info("listening for lifecycle hooks on %s:%d", args.host, args.port)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
