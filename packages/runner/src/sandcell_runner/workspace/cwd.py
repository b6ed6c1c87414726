"""A job's working directory: a directory of the workspace, checked without following links.

One check for every kind of job that takes a ``cwd`` (code contexts, app processes,
sandbox processes); each surface first turns the caller's path into a workspace
path by its own rule.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sandcell_protocol import ProtocolError, validate_workspace_path

from ..errors import InvalidPathError
from . import fsops

__all__ = ["require_dir", "workspace_cwd"]


async def require_dir(workspace: Path, relative: str, *, shown: str) -> str:
    """``relative`` if it names a directory under ``workspace`` (no link followed);
    ``InvalidPathError`` naming ``shown`` (the caller's spelling) otherwise."""

    def check() -> None:
        with fsops.open_dir(workspace, relative.split("/")):
            pass

    try:
        await asyncio.to_thread(check)
    except (FileNotFoundError, NotADirectoryError, fsops.UnsafePathError):
        raise InvalidPathError(f"cwd {shown!r} is not a directory") from None
    return relative


async def workspace_cwd(cwd: str | None, workspace: Path) -> str:
    """A ``cwd`` given as a workspace path (``""``: the root), checked to be a directory."""
    if cwd in (None, "", "."):
        return ""
    assert cwd is not None
    try:
        relative = validate_workspace_path(cwd)
    except ProtocolError as exc:
        raise InvalidPathError(f"invalid cwd: {exc}") from None
    return await require_dir(workspace, relative, shown=relative)
