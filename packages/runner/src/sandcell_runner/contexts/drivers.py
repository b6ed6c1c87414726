"""The context drivers as a job directory gets them: the files, and how each is started.

Python's driver is the package ``pydriver`` (standard library only), copied as
``sandcell_pydriver/`` beside a launcher ``driver.py``, which the jail's
``python3 -I`` runs; JavaScript's is one file, ``driver.js`` (``nodedriver``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .nodedriver import NODE_DRIVER

__all__ = ["DRIVERS", "Driver"]

_PYDRIVER = Path(__file__).with_name("pydriver")
_PY_PACKAGE = "sandcell_pydriver"
# -I keeps the script's directory off sys.path: the package beside it goes on for
# the one import and off again before any cell runs (the driver then puts the
# workspace there), so a cell's imports find what they found with one file.
_PY_LAUNCHER = f"""\
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from {_PY_PACKAGE}.main import main
del sys.path[0]
main(__file__)
""".encode()


@dataclass(frozen=True, slots=True)
class Driver:
    """How a language's driver is written into the job directory and started."""

    file_name: str
    """The script the interpreter runs, in the job directory."""
    files: Callable[[], Mapping[str, bytes]]
    """Every file to write, by path relative to the job directory."""
    flags: tuple[str, ...]


def _python_files() -> dict[str, bytes]:
    files = {"driver.py": _PY_LAUNCHER}
    for source in sorted(_PYDRIVER.glob("*.py")):
        files[f"{_PY_PACKAGE}/{source.name}"] = source.read_bytes()
    return files


DRIVERS = {
    # -I: no user site, no PYTHON* variables; the driver puts the workspace on sys.path.
    "python": Driver("driver.py", _python_files, ("-I",)),
    "node": Driver("driver.js", lambda: {"driver.js": NODE_DRIVER.encode()}, ()),
}
