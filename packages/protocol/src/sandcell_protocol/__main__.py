"""``python -m sandcell_protocol schema``: print the JSON Schema of every message."""

from __future__ import annotations

import json
import sys

from .schema import json_schema
from .version import PROTOCOL_VERSION


def main(argv: list[str]) -> int:
    if argv == ["schema"]:
        sys.stdout.write(json.dumps(json_schema(), indent=2, sort_keys=True) + "\n")
        return 0
    if argv == ["version"]:
        sys.stdout.write(PROTOCOL_VERSION + "\n")
        return 0
    sys.stderr.write("usage: python -m sandcell_protocol (schema | version)\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
