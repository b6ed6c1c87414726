"""``E2bSandbox``: one worker's view of an E2B sandbox (its registry row and a handle).

The row is the fleet's (``registry/e2b.py``); the handle and runner client are
this worker's, opened when it first reaches the sandbox and closed when the row
says the sandbox was paused, resumed elsewhere or killed.
"""

from __future__ import annotations

import hmac
import re
import secrets
from dataclasses import dataclass, field

import anyio

from ..handle import SandboxHandle
from ..providers.base import SandboxSpec
from ..registry import E2bSandboxRow
from ..runner.sandbox import SandboxRunnerClient
from .errors import E2bError

__all__ = [
    "ID_ALPHABET",
    "ID_CHARS",
    "E2bSandbox",
    "check_sandbox_id",
    "new_sandbox_id",
    "token_ok",
    "valid_sandbox_id",
]

ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
ID_CHARS = 20
"""The shape of every id this service hands out (sandboxes and snapshots): E2B's."""
_SANDBOX_ID_RE = re.compile(rf"[{ID_ALPHABET}]{{{ID_CHARS}}}")
# Compared against when there is no sandbox: the same work either way.
_NO_TOKEN = "x" * 43


def new_sandbox_id() -> str:
    """A fresh id of the shape ``valid_sandbox_id`` accepts (a snapshot's too)."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_CHARS))


def valid_sandbox_id(sandbox_id: str) -> bool:
    """Whether ``sandbox_id`` has the shape of the ids this service hands out."""
    return _SANDBOX_ID_RE.fullmatch(sandbox_id) is not None


def check_sandbox_id(sandbox_id: str) -> str:
    """``sandbox_id`` if it has the shape of the ids this service hands out, else a 404."""
    if not valid_sandbox_id(sandbox_id):
        raise E2bError(404, "not_found", f"sandbox {sandbox_id[:40]!r} not found")
    return sandbox_id


@dataclass(eq=False)
class E2bSandbox:
    """This worker's view of one E2B sandbox: its row, and a handle while it reaches it."""

    row: E2bSandboxRow
    spec: SandboxSpec
    handle: SandboxHandle | None = None
    runner: SandboxRunnerClient | None = None
    handle_resumes: int = 0
    """The row's ``resumes`` when ``handle`` was opened."""
    lock: anyio.Lock = field(default_factory=anyio.Lock, repr=False)
    gone: bool = False

    @property
    def sandbox_id(self) -> str:
        return self.row.sandbox_id

    @property
    def owner(self) -> str:
        return self.row.namespace

    @property
    def template(self) -> str:
        return self.row.template

    @property
    def template_id(self) -> str:
        """E2B's ``templateID``: the template, or the snapshot it was created from."""
        return self.row.template_id or self.row.template

    @property
    def alias(self) -> str | None:
        """E2B's ``alias`` (the SDK's ``SandboxInfo.name``): the template's name, or the
        snapshot's it was created from (None for an unnamed snapshot)."""
        return self.row.alias if self.row.template_id is not None else self.row.template

    @property
    def session_id(self) -> str:
        return self.row.session_id

    @property
    def access_token(self) -> str:
        return self.row.access_token

    @property
    def traffic_token(self) -> str:
        """What ``e2b-code-interpreter`` sends (``E2B-Traffic-Access-Token``) on the calls
        that carry no envd access token (its context calls)."""
        return self.row.traffic_token

    @property
    def metadata(self) -> dict[str, str]:
        return self.row.metadata

    @property
    def env(self) -> dict[str, str]:
        return self.row.env

    @property
    def started_at_s(self) -> float:
        return self.row.started_at_s

    @property
    def end_at_s(self) -> float:
        return self.row.end_at_s

    @property
    def auto_pause(self) -> bool:
        return self.row.auto_pause

    @property
    def state(self) -> str:
        return self.row.state


def token_ok(row: E2bSandboxRow | None, token: str | None, traffic_token: str | None) -> bool:
    """Whether ``token`` is ``row``'s access token (or ``traffic_token`` its traffic
    token), compared in constant time whether or not there is a row."""
    access = row.access_token if row is not None else _NO_TOKEN
    traffic = row.traffic_token if row is not None else _NO_TOKEN
    ok = hmac.compare_digest(access.encode(), (token or "").encode())
    if traffic_token is not None:
        ok = hmac.compare_digest(traffic.encode(), traffic_token.encode()) or ok
    return ok and row is not None
