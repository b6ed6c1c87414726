"""Bringing an app workspace up: copy the template, init git, install, start, wait ready.

Each step is a function of a ``SandboxHandle`` and its ``AppRunnerClient`` so
``AppInstances`` can run them at create time and again after a recovery (where
only the dev-server steps are needed: a restored session runs nothing).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio

from sandcell_protocol import ProcessStart

from ..errors import (
    SandboxCommandError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SandcellError,
)
from ..handle import SandboxHandle
from .client import AppRunnerClient
from .errors import InstanceStartError
from .settings import GitAuthor
from .templates import Template, TemplateManifest

__all__ = [
    "DEV_TAG",
    "copy_template",
    "dev_server_env",
    "git_init",
    "install",
    "start_dev_server",
    "wait_ready",
]

DEV_TAG = "dev"
"""The tag of the dev-server process in the runner's session."""

_READY_POLL_S = 0.2
_PROBE_TIMEOUT_S = 5.0
_TAIL_LINES = 30
_TAIL_CHARS = 2000
_NOT_LISTENING = frozenset({502, 503, 504})


def dev_server_env(manifest: TemplateManifest, env: Mapping[str, str]) -> dict[str, str]:
    """The dev server's environment: the caller's, plus ``PORT`` (which wins)."""
    return {**env, "PORT": str(manifest.preview_port)}


async def copy_template(handle: SandboxHandle, template: Template) -> None:
    """Write every template file into the session workspace, keeping the exec bit."""
    session_id = handle.session_id or ""
    for item in template.files:
        await handle.runner.write_file(item.path, item.data, session_id=session_id, mode=item.mode)


async def git_init(handle: SandboxHandle, *, template: str, author: GitAuthor) -> str:
    """Make the workspace a git repository whose first commit is the template."""
    await handle.git.init(branch="main")
    await handle.git.add(["."])
    return await handle.git.commit(
        f"Start from template {template}", author_name=author.name, author_email=author.email
    )


async def install(
    handle: SandboxHandle, manifest: TemplateManifest, env: Mapping[str, str]
) -> None:
    """Run the template's install command to completion (if it has one)."""
    if manifest.install is None:
        return
    try:
        await handle.commands.run(
            manifest.install.command, env=dict(env), timeout_s=manifest.install.timeout_s
        )
    except SandboxCommandError as exc:
        output = (exc.stdout + exc.stderr)[-_TAIL_CHARS:]
        raise InstanceStartError(
            f"the template's install command exited {exc.exit_code}: {output}"
        ) from None
    except SandboxTimeoutError:
        raise InstanceStartError(
            f"the template's install command ran over {manifest.install.timeout_s:g}s"
        ) from None


async def start_dev_server(
    runner: AppRunnerClient, manifest: TemplateManifest, env: Mapping[str, str]
) -> None:
    """(Re)start the dev server as the session's ``dev`` process."""
    with contextlib.suppress(SandcellError):
        # An exited process keeps its tag until removed; a running one is replaced.
        existing = await runner.process(DEV_TAG)
        if existing is not None:
            await runner.stop_process(DEV_TAG)
    await runner.start_process(
        ProcessStart(
            tag=DEV_TAG,
            command=manifest.start.command,
            env=dev_server_env(manifest, env),
        )
    )


async def wait_ready(
    runner: AppRunnerClient,
    manifest: TemplateManifest,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Poll the ready check until it passes; ``InstanceStartError`` with the log tail if not.

    Fails at once when the dev server exits: it will not become ready by itself.
    """
    check = manifest.ready
    deadline = clock() + check.timeout_s
    last = _Outcome("no answer yet")
    while True:
        process = await runner.process(DEV_TAG)
        if process is None or process.state == "exited":
            how = "is missing" if process is None else _ended(process.exit_code, process.signal)
            raise InstanceStartError(f"the dev server {how}: {await _tail(runner)}")
        outcome = await _probe(runner, manifest.ready_port, check.path)
        if outcome is None:
            return
        last = outcome
        if clock() >= deadline:
            raise InstanceStartError(
                f"the dev server was not ready in {check.timeout_s:g}s ({last.said}): "
                f"{await _tail(runner)}",
                log_detail=last.runner_said,
            )
        await anyio.sleep(_READY_POLL_S)


@dataclass(frozen=True, slots=True)
class _Outcome:
    """Why a probe failed: in our words, and what the runner said (for the log only:
    it names the runner's route)."""

    said: str
    runner_said: str | None = None


async def _probe(runner: AppRunnerClient, port: int, path: str | None) -> _Outcome | None:
    """``None`` when ready, else why not."""
    try:
        response = await runner.port_request(
            "GET",
            port,
            (path or "/").lstrip("/"),
            query="",
            request_headers={"Accept": "*/*"},
            read_timeout_s=_PROBE_TIMEOUT_S,
        )
    except SandboxTimeoutError as exc:
        return _Outcome(f"no answer in {_PROBE_TIMEOUT_S:g}s", str(exc)[:200])
    except SandboxUnavailableError as exc:
        return _Outcome("the sandbox did not answer", str(exc)[:200])
    await response.aclose()
    # Without a path any answer from the app will do; the runner's own 502/503/504
    # mean nothing listens yet. With a path the app itself must not fail.
    if path is None and response.status_code not in _NOT_LISTENING:
        return None
    if path is not None and response.status_code < 500:
        return None
    return _Outcome(f"HTTP {response.status_code}")


def _ended(exit_code: int | None, signal: str | None) -> str:
    return (
        f"exited {exit_code}" if exit_code is not None else f"was ended by {signal or 'a signal'}"
    )


async def _tail(runner: AppRunnerClient) -> str:
    try:
        logs = await runner.logs(DEV_TAG, lines=_TAIL_LINES)
    except SandcellError:
        return "(no logs)"
    return "\n".join(logs.lines)[-_TAIL_CHARS:] or "(no output)"
