"""sandcell's runner: the agent inside every sandbox image."""

from __future__ import annotations

from importlib.metadata import version as _dist_version

__version__ = _dist_version("sandcell-runner")

__all__ = ["__version__"]
