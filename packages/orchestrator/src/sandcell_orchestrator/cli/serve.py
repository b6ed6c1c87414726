"""``sandcell serve``: the HTTP API for control planes (imported only when chosen)."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import OrchestratorSettings

__all__ = ["add_parser", "run_serve"]


def add_parser(commands: Any) -> None:
    """Add ``serve`` to the ``sandcell`` sub-command parsers."""
    serve = commands.add_parser("serve", help="run the HTTP API for control planes")
    serve.add_argument("--host", help="listen address [SANDCELL_SERVE_HOST or 127.0.0.1]")
    serve.add_argument("--port", type=int, help="listen port [SANDCELL_SERVE_PORT or 8000]")


def run_serve(args: argparse.Namespace, settings: OrchestratorSettings) -> int:
    """Serve until stopped; the exit code."""
    # Lazy: starlette and uvicorn load only for serve, not for every exec.
    from ..serve.app import serve

    return serve(settings, host=args.host, port=args.port)
