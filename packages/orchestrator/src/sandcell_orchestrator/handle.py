"""``SandboxHandle``: one sandbox as feature code sees it (commands, files, git).

Built on ``RunnerClient`` only, so it works the same for every provider. Commands
run as ``bash`` jobs (in the runtime session when the handle has one); files need
a session because a runner serves files only from its session workspace.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sandcell_protocol import (
    ExecuteRequest,
    FileEntry,
    ProtocolError,
    RunStatus,
    validate_workspace_path,
)

from .contexts import Contexts
from .errors import (
    RunnerRequestError,
    SandboxCommandError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SessionRequiredError,
)
from .runner.client import RunnerClient
from .runner.errors import Redactor

__all__ = [
    "CommandResult",
    "Commands",
    "Files",
    "Git",
    "SandboxHandle",
    "validate_branch",
    "validate_remote_url",
]

_COMMAND_MARGIN_S = 10.0
_ERROR_TAIL_CHARS = 400


@dataclass(frozen=True, slots=True)
class CommandResult:
    """A command that exited 0."""

    exit_code: int
    stdout: str
    stderr: str
    status: str
    wall_ms: int


def _workspace_path(path: str, *, allow_root: bool = False) -> str:
    """A validated workspace path; ``"."`` stays the root when ``allow_root``."""
    if allow_root and path in ("", "."):
        return "."
    try:
        return validate_workspace_path(path)
    except ProtocolError as exc:
        raise RunnerRequestError(f"refused before sending: {exc}", code="invalid_path") from None


class Commands:
    """Shell commands in the sandbox (``bash -c`` semantics, run from the workspace root)."""

    def __init__(self, runner: RunnerClient, session_id: str | None) -> None:
        self._runner = runner
        self._session_id = session_id

    async def run(
        self,
        cmd: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 60,
    ) -> CommandResult:
        """Run ``cmd``; a non-zero exit raises ``SandboxCommandError``, a timeout
        ``SandboxTimeoutError``. ``cwd`` is a workspace path."""
        script = cmd
        if cwd is not None:
            script = f"cd -- {shlex.quote(_workspace_path(cwd, allow_root=True))} || exit\n{cmd}"
        request = ExecuteRequest(
            language="bash",
            code=script,
            env=dict(env or {}),
            timeout_ms=max(1, int(timeout_s * 1000)),
        )
        result = await self._runner.execute(
            request, session_id=self._session_id, timeout_s=timeout_s + _COMMAND_MARGIN_S
        )
        if result.status is RunStatus.TIMEOUT:
            raise SandboxTimeoutError(f"command timed out after {timeout_s:g}s")
        if result.status is RunStatus.INTERNAL_ERROR:
            raise SandboxUnavailableError("the runner failed to run the command")
        if result.status is not RunStatus.OK or result.exit_code != 0:
            how = (
                f"exited {result.exit_code}"
                if result.exit_code is not None
                else f"ended by {result.signal or 'a signal'}"
            )
            raise SandboxCommandError(
                f"command {how} ({result.status.value}): {result.stderr[-_ERROR_TAIL_CHARS:]}",
                exit_code=result.exit_code,
                stdout=result.stdout,
                stderr=result.stderr,
            )
        return CommandResult(
            exit_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
            status=result.status.value,
            wall_ms=result.wall_ms,
        )


class Files:
    """The session workspace's files; every operation needs a runtime session."""

    def __init__(self, runner: RunnerClient, session_id: str | None) -> None:
        self._runner = runner
        self._session_id = session_id

    def _session(self) -> str:
        if self._session_id is None:
            raise SessionRequiredError("file operations need a sandbox bound to a runtime session")
        return self._session_id

    async def read(self, path: str) -> str:
        """A file's text (UTF-8; ``UnicodeDecodeError`` if it is not)."""
        return (await self.read_bytes(path)).decode("utf-8")

    async def read_bytes(self, path: str) -> bytes:
        """A file's bytes."""
        return await self._runner.read_file(path, session_id=self._session())

    async def write(self, path: str, data: str | bytes) -> FileEntry:
        """Create or replace a file (parents are created); ``str`` is written as UTF-8."""
        raw = data.encode("utf-8") if isinstance(data, str) else data
        return await self._runner.write_file(path, raw, session_id=self._session())

    async def remove(self, path: str) -> None:
        """Delete a file or directory tree."""
        await self._runner.delete_file(path, session_id=self._session())

    async def list(self, path: str = "") -> list[FileEntry]:
        """The direct entries of a directory ("" = the workspace root)."""
        listing = await self._runner.list_files(path, session_id=self._session())
        return listing.entries


# check-ref-format, conservatively: ASCII word characters, '.', '-', '/' only, and
# none of the sequences git forbids ('..', '//', '@{', '.lock' ends, leading '-' or '.').
_BRANCH_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,199}")
_REMOTE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}")
_HTTPS_URL_RE = re.compile(
    r"https://[A-Za-z0-9.\-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%!$&'()*+,;=:@/\-]*)?"
)
_LOCAL_PATH_RE = re.compile(r"/?[A-Za-z0-9_.][A-Za-z0-9_.\-/]*")
_HEADER_VALUE_RE = re.compile(r"[\x21-\x7e][\x20-\x7e]*")
_IDENTITY_RE = re.compile(r"[^\x00-\x1f\x7f<>]{1,200}")

# Per-invocation git configuration: only the command line and the environment, so
# no file, no user config (the workspace is $HOME) and no hook sees a credential.
_GIT_ENV = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}
_GIT_HARDENING = ("core.hooksPath=/dev/null", "core.fsmonitor=false", "credential.helper=")


def _reject(what: str, value: str) -> RunnerRequestError:
    return RunnerRequestError(
        f"refused before sending: invalid {what} {value[:100]!r}", code="bad_request"
    )


def validate_branch(name: str) -> str:
    """``name`` if it is a safe branch name (a conservative subset of check-ref-format)."""
    parts = name.split("/")
    if (
        not _BRANCH_RE.fullmatch(name)
        or ".." in name
        or "@{" in name
        or name.endswith((".", "/"))
        or any(not part or part.startswith(".") or part.endswith(".lock") for part in parts)
    ):
        raise _reject("branch name", name)
    return name


def validate_remote_url(url: str) -> str:
    """``url`` if it is an https URL without credentials, or a local path."""
    if url.startswith("https://"):
        if not _HTTPS_URL_RE.fullmatch(url):
            raise _reject("repository URL (https, no user info)", url)
        return url
    if _LOCAL_PATH_RE.fullmatch(url) and ".." not in url.split("/"):
        return url
    raise _reject("repository URL (https:// or a local path)", url)


class Git:
    """Git in the sandbox, built on ``Commands``.

    Credentials (``auth_header``: the ``Authorization`` value, e.g. ``"Bearer …"``)
    reach git through ``GIT_CONFIG_*`` environment variables for that one
    invocation: never the repository config, the remote URL, a file or the command
    line. While that command runs the sandbox can see the credential, so pass a
    short-lived, narrowly scoped one. It is scrubbed from every error.
    """

    def __init__(self, commands: Commands) -> None:
        self._commands = commands

    async def _git(
        self,
        args: Iterable[str],
        *,
        path: str = ".",
        auth_header: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300,
    ) -> str:
        config = list(_GIT_HARDENING)
        redact = Redactor()
        if auth_header is not None:
            if not _HEADER_VALUE_RE.fullmatch(auth_header):
                raise RunnerRequestError(
                    "refused before sending: auth_header must be printable ASCII",
                    code="bad_request",
                )
            redact.add(auth_header)
            config.append(f"http.extraHeader=Authorization: {auth_header}")
        git_env = {**_GIT_ENV, **(env or {}), "GIT_CONFIG_COUNT": str(len(config))}
        for index, item in enumerate(config):
            key, _, value = item.partition("=")
            git_env[f"GIT_CONFIG_KEY_{index}"] = key
            git_env[f"GIT_CONFIG_VALUE_{index}"] = value
        argv = ["git", "-C", _workspace_path(path, allow_root=True), *args]
        try:
            result = await self._commands.run(shlex.join(argv), env=git_env, timeout_s=timeout_s)
        except SandboxCommandError as exc:
            raise SandboxCommandError(
                redact(str(exc)),
                exit_code=exc.exit_code,
                stdout=redact(exc.stdout),
                stderr=redact(exc.stderr),
            ) from None
        return redact(result.stdout)

    async def init(self, *, branch: str = "main", path: str = ".") -> None:
        """Make the workspace directory ``path`` (created if missing) a repository whose
        first branch is ``branch``."""
        initial = f"--initial-branch={validate_branch(branch)}"
        await self._git(["init", "--quiet", initial, "--", _workspace_path(path, allow_root=True)])

    async def clone(
        self,
        url: str,
        *,
        path: str = ".",
        branch: str | None = None,
        auth_header: str | None = None,
    ) -> None:
        """Clone ``url`` into the workspace directory ``path``."""
        args = ["clone", "--quiet"]
        if branch is not None:
            args += ["--branch", validate_branch(branch)]
        args += ["--", validate_remote_url(url), _workspace_path(path, allow_root=True)]
        await self._git(args, auth_header=auth_header)

    async def status(self, *, path: str = ".") -> str:
        """``git status --porcelain=v1 --branch``: stable, machine-readable."""
        return await self._git(["status", "--porcelain=v1", "--branch"], path=path)

    async def create_branch(self, name: str, *, path: str = ".") -> None:
        """Create branch ``name`` at HEAD and switch to it."""
        await self._git(["switch", "--quiet", "-c", validate_branch(name)], path=path)

    async def add(self, paths: Iterable[str] = (".",), *, path: str = ".") -> None:
        """Stage ``paths`` (relative to the repository)."""
        checked = [_workspace_path(item, allow_root=True) for item in paths]
        await self._git(["add", "--", *checked], path=path)

    async def commit(
        self, message: str, *, author_name: str, author_email: str, path: str = "."
    ) -> str:
        """Commit what is staged; returns the new commit's sha."""
        for what, value in (("author name", author_name), ("author email", author_email)):
            if not _IDENTITY_RE.fullmatch(value):
                raise _reject(what, value)
        identity = {
            "GIT_AUTHOR_NAME": author_name,
            "GIT_AUTHOR_EMAIL": author_email,
            "GIT_COMMITTER_NAME": author_name,
            "GIT_COMMITTER_EMAIL": author_email,
        }
        await self._git(["commit", "--quiet", "-m", message], path=path, env=identity)
        return (await self._git(["rev-parse", "HEAD"], path=path)).strip()

    async def push(
        self,
        remote: str = "origin",
        branch: str | None = None,
        *,
        auth_header: str | None = None,
        path: str = ".",
    ) -> None:
        """Push ``branch`` (default: the current branch, as ``HEAD``) to ``remote``."""
        if not _REMOTE_RE.fullmatch(remote):
            raise _reject("remote name", remote)
        refspec = "HEAD" if branch is None else validate_branch(branch)
        await self._git(["push", "--quiet", remote, refspec], path=path, auth_header=auth_header)


class SandboxHandle:
    """One sandbox: its ids, its runner client, and commands / files / git / code
    contexts on top."""

    def __init__(
        self,
        *,
        sandbox_id: str,
        provider: str,
        runner: RunnerClient,
        session_id: str | None,
        endpoint: str | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.provider = provider
        self.runner = runner
        self.session_id = session_id
        self.endpoint = endpoint
        self.commands = Commands(runner, session_id)
        self.files = Files(runner, session_id)
        self.git = Git(self.commands)
        self.contexts = Contexts(runner, session_id)

    def __repr__(self) -> str:
        return (
            f"SandboxHandle(sandbox_id={self.sandbox_id!r}, provider={self.provider!r},"
            f" session_id={self.session_id!r})"
        )

    async def close(self) -> None:
        """Close the runner client (the sandbox itself lives on); idempotent."""
        await self.runner.close()
