"""The app side of the bound session: processes, runtime errors, preview upstream, analysis.

Created with the session's first app call, dropped when the session is released
(its processes are stopped first, before the workspace is wiped). The session's
network namespace itself belongs to ``SessionState`` (made at bind, so even the
first ``/v1/execute`` of a session runs in it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import RunnerSettings
from ..jail.netns import NetnsUnavailableError, SessionNetns, create_netns
from ..jail.nsjail import Jail
from ..languages import LanguageSpec
from ..preview.proxy import PreviewUpstream
from ..preview.relays import PreviewRelays
from ..session_process import SessionTarget
from ..workspace.manager import WorkspaceManager
from ..workspace.session import SessionState
from .analysis import Analyzer, Checkers, find_ruff
from .processes import ProcessManager
from .runtime_errors import RuntimeErrorStore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SessionApp:
    """Per-session app state."""

    session_id: str
    errors: RuntimeErrorStore
    processes: ProcessManager
    upstream: PreviewUpstream | None
    files_version: int = 0
    """Grows with every file the session's file routes write or remove (live reload)."""


class AppManager:
    """Holds the ``SessionApp`` of the bound session and what every session shares."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        jail: Jail,
        workspaces: WorkspaceManager,
        languages: dict[str, LanguageSpec],
    ) -> None:
        self._settings = settings
        self._jail = jail
        self._workspaces = workspaces
        python = languages.get("python")
        node = languages.get("node")
        bash = languages.get("bash")
        self.checkers = Checkers(
            ruff=find_ruff(),
            python=python.binary if python else None,
            node=node.binary if node else None,
            bash=bash.binary if bash else "/bin/bash",
        )
        self.analyzer = Analyzer(settings, jail=jail, checkers=self.checkers)
        self.preview_unavailable = self._why_no_netns()
        self.relays = PreviewRelays.create(
            max_websockets=settings.max_relayed_websockets,
            max_requests=settings.max_relayed_requests,
        )
        """What the preview relays at once, capped (one runner, one sandbox)."""
        self._apps: dict[str, SessionApp] = {}

    def _why_no_netns(self) -> str | None:
        if not self._jail.jailed:
            return "preview needs the jail (SANDCELL_RUNNER_JAIL=none)"
        if self._settings.allow_network:
            # Jobs then share the host's network; a proxy to "localhost" would reach the
            # host's own services, not the session's.
            return "preview is off while SANDCELL_RUNNER_ALLOW_NETWORK=1"
        return None

    def create_netns(self) -> SessionNetns | None:
        """A session namespace, or None (logged once per session) when this runner cannot."""
        if self.preview_unavailable is not None:
            return None
        try:
            return create_netns()
        except (NetnsUnavailableError, OSError) as exc:
            log.warning("session network namespace unavailable: %s", exc)
            return None

    def files_changed(self, session_id: str) -> None:
        """Count a write or removal through the file routes, for open previews to reload."""
        app = self._apps.get(session_id)
        if app is not None:
            app.files_version += 1

    def get(self, state: SessionState) -> SessionApp:
        """The session's app state, created on first use."""
        app = self._apps.get(state.session_id)
        if app is None:
            errors = RuntimeErrorStore()
            app = SessionApp(
                session_id=state.session_id,
                errors=errors,
                processes=ProcessManager(
                    self._settings,
                    jail=self._jail,
                    workspaces=self._workspaces,
                    errors=errors,
                    python=self.checkers.python,
                    bash=self.checkers.bash,
                ),
                upstream=PreviewUpstream(state.netns) if state.netns is not None else None,
            )
            self._apps[state.session_id] = app
        return app

    def target(self, state: SessionState) -> SessionTarget:
        return SessionTarget(
            workspace=state.workspace,
            uid=state.uid,
            netns_fd=state.netns.fd if state.netns is not None else None,
        )

    async def release(self, state: SessionState) -> None:
        """End the session's relays, stop its processes and close its upstream pool
        (idempotent)."""
        self.relays.abort_session(state.session_id)
        app = self._apps.pop(state.session_id, None)
        if app is None:
            return
        await app.processes.stop_all()
        if app.upstream is not None:
            await app.upstream.aclose()

    async def shutdown(self) -> None:
        for app in list(self._apps.values()):
            self.relays.abort_session(app.session_id)
            await app.processes.stop_all()
            if app.upstream is not None:
                await app.upstream.aclose()
        self._apps.clear()

    def keep_paths(self) -> set[Path]:
        keep: set[Path] = set()
        for app in self._apps.values():
            keep |= app.processes.keep_paths()
        return keep


__all__ = ["AppManager", "SessionApp"]
