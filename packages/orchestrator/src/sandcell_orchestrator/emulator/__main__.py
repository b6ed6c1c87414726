"""``python -m sandcell_orchestrator.emulator --port N``: serve the MicroVM emulator."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import tempfile
from pathlib import Path

import uvicorn

from .lambda_microvms import MicrovmEmulator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sandcell_orchestrator.emulator",
        description="Emulate the AWS Lambda MicroVMs API; each VM is a sandcell-runner process.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument(
        "--base-dir",
        type=Path,
        default=None,
        help="where VM workspaces live (made 0711; default: a new directory under $TMPDIR)",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    base_dir = args.base_dir
    owned = base_dir is None
    if base_dir is None:
        base_dir = Path(tempfile.mkdtemp(prefix="sandcell-microvms-"))
    # uvicorn shuts down on SIGTERM, then re-raises the signal to the handler it
    # found: make that one an exit that unwinds, so the finally below still runs.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _serve(args, base_dir)
    finally:
        if owned:
            # uvicorn shuts down on SIGTERM/SIGINT and the emulator's lifespan
            # terminates every VM (removing its root, unmounting first), so the
            # directory is empty by now; anything left is kept to be looked at.
            with contextlib.suppress(OSError):
                base_dir.rmdir()


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _serve(args: argparse.Namespace, base_dir: Path) -> int:
    base_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
    # Job UIDs must traverse every ancestor of a runner's workspace root.
    os.chmod(base_dir, 0o711)  # noqa: S103
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per proxied request is noise; the emulator logs VM state changes.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    emulator = MicrovmEmulator(base_dir=base_dir)
    logging.getLogger(__name__).info(
        "MicroVM emulator on http://%s:%d (VMs under %s)", args.host, args.port, base_dir
    )
    uvicorn.run(
        emulator.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
