"""``sandcell``: the command-line interface."""

from __future__ import annotations

import sys


def main() -> int:
    sys.stderr.write("sandcell: not implemented yet\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
