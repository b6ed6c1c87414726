"""sandcell's orchestrator: what a control plane embeds."""

from __future__ import annotations

from importlib.metadata import version as _dist_version

__version__ = _dist_version("sandcell-orchestrator")

__all__ = ["__version__"]
