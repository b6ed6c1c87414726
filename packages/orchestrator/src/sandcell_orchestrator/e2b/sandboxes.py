"""``E2bSandboxes``: E2B sandboxes as ``SandboxManager`` sessions, scoped by tenant.

Each E2B sandbox is one manager session (``sandbox_session_key`` of a fresh
uuid), acquired at create, suspended at pause (natively on Lambda MicroVMs,
checkpoint-and-destroy elsewhere: the manager's one suspend policy), resumed at
connect (the workspace restored before anything runs) and destroyed at kill or
when its timeout passes (paused instead with ``autoPause``). The table of
sandboxes, their envd access tokens and timeouts lives in this process, like the
app instances: sandboxes do not survive it (``aclose`` destroys them).

Tenants are walls: every lookup by id is scoped by the caller's namespace, and
another tenant's sandbox answers exactly as a missing one. The envd side finds a
sandbox by id and access token together (a wrong token reads as no sandbox).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import anyio

from sandcell_protocol import EgressPolicy

from ..errors import SandcellError
from ..handle import SandboxHandle
from ..providers.base import SandboxSpec
from ..runner.sandbox import SandboxRunnerClient
from ..sessions.manager import SandboxManager, sandbox_session_key
from .errors import E2bError

__all__ = [
    "DEFAULT_TEMPLATES",
    "E2bSandbox",
    "E2bSandboxes",
    "check_sandbox_id",
]

log = logging.getLogger(__name__)

_SANDBOX_ID_RE = re.compile(r"[a-z0-9]{20}")
_IDEMPOTENCY_KEY_RE = re.compile(r"[a-z0-9-]{1,255}")
_OWNER_LABEL = "sandcell.e2b_sandbox"
_RETRY_EXPIRY_S = 30.0

DEFAULT_TEMPLATES: Mapping[str, SandboxSpec] = {
    "base": SandboxSpec(),
    "code-interpreter-v1": SandboxSpec(),
}
"""E2B template names served by default, each a sandcell sandbox spec."""


def check_sandbox_id(sandbox_id: str) -> str:
    """``sandbox_id`` if it has the shape of the ids this service hands out, else a 404."""
    if not _SANDBOX_ID_RE.fullmatch(sandbox_id):
        raise E2bError(404, "not_found", f"sandbox {sandbox_id[:40]!r} not found")
    return sandbox_id


def _new_sandbox_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(20))


@dataclass(eq=False)
class E2bSandbox:
    """One E2B sandbox. ``handle``/``runner`` are set while it runs."""

    sandbox_id: str
    owner: str
    template: str
    session_id: str
    spec: SandboxSpec
    access_token: str = field(repr=False)
    traffic_token: str = field(repr=False)
    """What ``e2b-code-interpreter`` sends (``E2B-Traffic-Access-Token``) on the calls
    that carry no envd access token (its context calls)."""
    metadata: dict[str, str]
    env: dict[str, str] = field(repr=False)
    started_at_s: float
    end_at_s: float
    auto_pause: bool
    state: str = "running"
    handle: SandboxHandle | None = None
    runner: SandboxRunnerClient | None = None
    lock: anyio.Lock = field(default_factory=anyio.Lock, repr=False)
    gone: bool = False


class E2bSandboxes:
    """Create, find, time out, pause, resume and kill E2B sandboxes."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        templates: Mapping[str, SandboxSpec] = DEFAULT_TEMPLATES,
        default_timeout_s: int = 300,
        max_timeout_s: int = 86_400,
        max_running_per_tenant: int = 32,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = _new_sandbox_id,
        new_token: Callable[[], str] = lambda: secrets.token_urlsafe(32),
    ) -> None:
        self.manager = manager
        self.templates = dict(templates)
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.max_running_per_tenant = max_running_per_tenant
        self._now = wall_clock
        self._new_id = new_id
        self._new_token = new_token
        self._sandboxes: dict[str, E2bSandbox] = {}
        self._idempotent: dict[tuple[str, str], str] = {}

    def __repr__(self) -> str:
        return f"E2bSandboxes(sandboxes={len(self._sandboxes)})"

    # -- lookups ------------------------------------------------------------------------

    def get(self, sandbox_id: str, *, owner: str) -> E2bSandbox:
        """``owner``'s sandbox; a 404 for a missing one and another tenant's alike."""
        found = self._sandboxes.get(check_sandbox_id(sandbox_id))
        if found is None or found.owner != owner or found.gone:
            raise E2bError(404, "not_found", f"sandbox {sandbox_id} not found")
        return found

    def owned_by(self, owner: str) -> list[E2bSandbox]:
        """``owner``'s sandboxes, oldest first."""
        return [s for s in self._sandboxes.values() if s.owner == owner and not s.gone]

    def for_envd(
        self, sandbox_id: str | None, token: str | None, *, traffic_token: str | None = None
    ) -> E2bSandbox | None:
        """The sandbox named by a request to one of its ports, if ``token`` is its envd
        access token (or, where allowed, ``traffic_token`` its traffic token)."""
        found = self._sandboxes.get(sandbox_id or "")
        access = found.access_token if found is not None else "x" * 43
        traffic = found.traffic_token if found is not None else "y" * 43
        ok = hmac.compare_digest(access.encode(), (token or "").encode())
        if traffic_token is not None:
            ok = hmac.compare_digest(traffic.encode(), traffic_token.encode()) or ok
        if not ok or found is None or found.gone:
            return None
        return found

    # -- create ---------------------------------------------------------------------------

    def _timeout(self, timeout_s: int | None) -> int:
        value = self.default_timeout_s if timeout_s is None else timeout_s
        if not 0 < value <= self.max_timeout_s:
            raise E2bError(400, "bad_request", f"timeout: must be 1..{self.max_timeout_s} seconds")
        return value

    async def create(
        self,
        *,
        owner: str,
        template: str,
        timeout_s: int | None,
        metadata: Mapping[str, str],
        env: Mapping[str, str],
        auto_pause: bool,
        idempotency_key: str | None = None,
        egress: EgressPolicy | None = None,
    ) -> E2bSandbox:
        """Acquire a sandbox for ``owner`` from ``template`` (a retry with the same
        ``idempotency_key`` answers the sandbox the first call made)."""
        if idempotency_key is not None:
            if not _IDEMPOTENCY_KEY_RE.fullmatch(idempotency_key):
                raise E2bError(400, "bad_request", "Idempotency-Key: 1-255 of [a-z0-9-]")
            known = self._idempotent.get((owner, idempotency_key))
            if known is not None and known in self._sandboxes:
                return self.get(known, owner=owner)
        spec = self.templates.get(template)
        if spec is None:
            raise E2bError(404, "not_found", f"template {template[:80]!r} not found")
        timeout = self._timeout(timeout_s)
        self._check_room(owner)
        # Once a sandbox is being made, it is made and registered even if the caller
        # goes away: a half-made one would be nobody's to destroy.
        with anyio.CancelScope(shield=True):
            created = await self._create(
                owner=owner,
                template=template,
                spec=spec,
                timeout_s=timeout,
                metadata=metadata,
                env=env,
                auto_pause=auto_pause,
                idempotency_key=idempotency_key,
                egress=egress,
            )
        return created  # noqa: RET504 (a cancel scope may end the block: mypy needs it here)

    def _check_room(self, owner: str) -> None:
        running = sum(s.state == "running" for s in self.owned_by(owner))
        if running >= self.max_running_per_tenant:
            raise E2bError(
                429,
                "busy",
                f"at most {self.max_running_per_tenant} running sandboxes per tenant;"
                " kill or pause one first",
            )

    async def _create(
        self,
        *,
        owner: str,
        template: str,
        spec: SandboxSpec,
        timeout_s: int,
        metadata: Mapping[str, str],
        env: Mapping[str, str],
        auto_pause: bool,
        idempotency_key: str | None,
        egress: EgressPolicy | None = None,
    ) -> E2bSandbox:
        sandbox_id = self._new_id()
        session_id = sandbox_session_key(str(uuid.uuid4()))
        spec = SandboxSpec(
            image=spec.image,
            template=spec.template,
            turn_timeout_s=spec.turn_timeout_s,
            env=spec.env,
            egress=egress if egress is not None else spec.egress,
            limits=spec.limits,
            labels={**spec.labels, _OWNER_LABEL: sandbox_id},
        )
        handle = await self.manager.acquire(session_id, spec, owner=owner)
        now = self._now()
        sandbox = E2bSandbox(
            sandbox_id=sandbox_id,
            owner=owner,
            template=template,
            session_id=session_id,
            spec=spec,
            access_token=self._new_token(),
            traffic_token=self._new_token(),
            metadata=dict(metadata),
            env=dict(env),
            started_at_s=now,
            end_at_s=now + timeout_s,
            auto_pause=auto_pause,
            handle=handle,
            runner=SandboxRunnerClient.for_handle(handle),
        )
        self._sandboxes[sandbox_id] = sandbox
        if idempotency_key is not None:
            self._idempotent[(owner, idempotency_key)] = sandbox_id
        log.info("e2b sandbox %s created from template %s", sandbox_id, template)
        return sandbox

    # -- timeouts ---------------------------------------------------------------------------

    def set_timeout(self, sandbox: E2bSandbox, timeout_s: int) -> None:
        """The sandbox now ends ``timeout_s`` seconds from now (shorter or longer)."""
        sandbox.end_at_s = self._now() + self._timeout(timeout_s)

    async def expire(self) -> int:
        """Kill (or, with ``autoPause``, pause) running sandboxes past their end; how many."""
        now = self._now()
        due = [s for s in self._sandboxes.values() if s.state == "running" and s.end_at_s <= now]
        for sandbox in due:
            try:
                if sandbox.auto_pause:
                    await self.pause(sandbox)
                else:
                    await self.kill(sandbox)
            except SandcellError as exc:
                # Tried again later, not on every sweep.
                sandbox.end_at_s = self._now() + _RETRY_EXPIRY_S
                log.warning("e2b sandbox %s: timeout action failed: %s", sandbox.sandbox_id, exc)
        return len(due)

    # -- pause, connect, kill ------------------------------------------------------------

    async def pause(self, sandbox: E2bSandbox) -> bool:
        """Suspend a running sandbox (its workspace is saved); False if already paused."""
        async with sandbox.lock:
            if sandbox.gone:
                raise E2bError(404, "not_found", f"sandbox {sandbox.sandbox_id} not found")
            if sandbox.state == "paused":
                return False
            # Suspended first: if that fails the sandbox runs on, reachable as before.
            await self.manager.suspend(sandbox.session_id)
            await self._close_handle(sandbox)
            sandbox.state = "paused"
        log.info("e2b sandbox %s paused", sandbox.sandbox_id)
        return True

    async def connect(self, sandbox: E2bSandbox, *, timeout_s: int | None) -> E2bSandbox:
        """Resume a paused sandbox (workspace restored first); a running one's timeout is
        extended when ``timeout_s`` ends later than its current end."""
        async with sandbox.lock:
            if sandbox.gone:
                raise E2bError(404, "not_found", f"sandbox {sandbox.sandbox_id} not found")
            end = self._now() + self._timeout(timeout_s)
            if sandbox.state == "paused":
                self._check_room(sandbox.owner)
                handle = await self.manager.resume(sandbox.session_id, sandbox.spec)
                sandbox.handle = handle
                sandbox.runner = SandboxRunnerClient.for_handle(handle)
                sandbox.state = "running"
                sandbox.end_at_s = end
                log.info("e2b sandbox %s resumed", sandbox.sandbox_id)
            elif timeout_s is not None and end > sandbox.end_at_s:
                sandbox.end_at_s = end
        return sandbox

    async def kill(self, sandbox: E2bSandbox) -> None:
        """Destroy the sandbox, its checkpoints and its row (idempotent)."""
        with anyio.CancelScope(shield=True):
            async with sandbox.lock:
                if sandbox.gone:
                    return
                sandbox.gone = True
                self._sandboxes.pop(sandbox.sandbox_id, None)
                self._idempotent = {
                    k: v for k, v in self._idempotent.items() if v != sandbox.sandbox_id
                }
                await self._close_handle(sandbox)
                try:
                    await self.manager.destroy(sandbox.session_id)
                except SandcellError as exc:
                    log.warning("e2b sandbox %s: destroy failed: %s", sandbox.sandbox_id, exc)
        log.info("e2b sandbox %s killed", sandbox.sandbox_id)

    async def _close_handle(self, sandbox: E2bSandbox) -> None:
        handle, sandbox.handle, sandbox.runner = sandbox.handle, None, None
        if handle is not None:
            with contextlib.suppress(SandcellError):
                await handle.close()

    async def aclose(self) -> None:
        """Kill every sandbox: none could be found again after this process."""
        for sandbox in list(self._sandboxes.values()):
            await self.kill(sandbox)
