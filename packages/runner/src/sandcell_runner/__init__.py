"""sandcell's runner: the agent inside every sandbox image."""

from __future__ import annotations

# A constant, not importlib.metadata (~40 ms at every start-up); a test checks it
# equals the installed distribution's version.
__version__ = "0.1.0"

__all__ = ["__version__"]
