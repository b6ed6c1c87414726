"""The sandbox side of the bound session: its ``SandboxProcesses``, made on first use.

Dropped when the session is released (its processes are stopped first, before
the workspace is wiped), like the app side (``apps/manager.py``).
"""

from __future__ import annotations

from pathlib import Path

from ..config import RunnerSettings
from ..errors import BadRequestError
from ..jail.nsjail import Jail
from ..session_process import SessionTarget
from ..workspace.manager import WorkspaceManager
from ..workspace.session import SessionState
from .processes import SandboxProcesses


class SandboxSessions:
    """Holds the ``SandboxProcesses`` of the bound session."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        jail: Jail,
        workspaces: WorkspaceManager,
        python: str | None,
    ) -> None:
        self._settings = settings
        self._jail = jail
        self._workspaces = workspaces
        self._python = python
        self._processes: dict[str, SandboxProcesses] = {}

    def processes(self, state: SessionState) -> SandboxProcesses:
        """The session's processes (``BadRequestError`` when this runner has no python:
        the sandbox init is a python program)."""
        found = self._processes.get(state.session_id)
        if found is None:
            if self._python is None:
                raise BadRequestError("sandbox processes need python in the runner image")
            found = SandboxProcesses(
                self._settings, jail=self._jail, workspaces=self._workspaces, python=self._python
            )
            self._processes[state.session_id] = found
        return found

    @staticmethod
    def target(state: SessionState) -> SessionTarget:
        return SessionTarget(
            workspace=state.workspace,
            uid=state.uid,
            netns_fd=state.netns.fd if state.netns is not None else None,
        )

    async def release(self, state: SessionState) -> None:
        """Stop the session's processes (idempotent)."""
        found = self._processes.pop(state.session_id, None)
        if found is not None:
            await found.stop_all()

    async def shutdown(self) -> None:
        for found in list(self._processes.values()):
            await found.stop_all()
        self._processes.clear()

    def keep_paths(self) -> set[Path]:
        keep: set[Path] = set()
        for found in self._processes.values():
            keep |= found.keep_paths()
        return keep


__all__ = ["SandboxSessions"]
