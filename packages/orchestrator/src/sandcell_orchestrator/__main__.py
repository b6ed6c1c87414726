"""``sandcell`` / ``python -m sandcell_orchestrator``: the command-line interface."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
