"""``python -m sandcell_orchestrator.emulator --port N``: serve the MicroVM emulator."""

from __future__ import annotations

import argparse
import logging
import os
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
    if base_dir is None:
        base_dir = Path(tempfile.mkdtemp(prefix="sandcell-microvms-"))
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
