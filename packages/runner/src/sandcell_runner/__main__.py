"""``sandcell-runner``: serve the runner with uvicorn."""

from __future__ import annotations

import sys


def main() -> int:
    sys.stderr.write("sandcell-runner: not implemented yet\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
