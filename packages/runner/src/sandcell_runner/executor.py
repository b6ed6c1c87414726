"""One execution: validate, prepare the workspace, run the jail, classify, collect outputs.

The workspace a job runs in is chosen per request by the caller: a fresh one per
job (``run_fresh``) or the bound session's (``run_in``), so session state slots in
without this module knowing how sessions are kept.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from dataclasses import dataclass
from functools import partial

from sandcell_protocol import (
    ExecuteRequest,
    ExecuteResult,
    FileRef,
    ProtocolError,
    RunStatus,
    SurfacedOutput,
    validate_workspace_path,
)

from .config import MIB, RunnerSettings
from .env_vars import checked_env
from .errors import BadRequestError, InvalidPathError, UnsupportedLanguageError
from .jail.capture import OutputCallback
from .jail.nsjail import Jail
from .jail.outcome import JobOutcome
from .jail.spec import JobLimits, JobSpec
from .languages import LANGUAGE_ALIASES, LanguageSpec, resolve_language
from .outputs import Collected, OutputCollector
from .workspace import fsops
from .workspace.entry import write_entry
from .workspace.manager import JobWorkspace, WorkspaceManager

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InlineInput:
    """A decoded, validated inline file."""

    name: str
    content: bytes
    executable: bool


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """An ``ExecuteRequest`` that passed validation: nothing is written before this exists."""

    request: ExecuteRequest
    language: LanguageSpec
    inline_files: list[InlineInput]
    refs: list[FileRef]
    limits: JobLimits
    env: dict[str, str]


class Executor:
    """Validates requests and runs them in a workspace the caller provides."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        jail: Jail,
        workspaces: WorkspaceManager,
        languages: dict[str, LanguageSpec],
        outputs: OutputCollector,
    ) -> None:
        self._settings = settings
        self._jail = jail
        self._workspaces = workspaces
        self._outputs = outputs
        self.languages = languages

    def prepare(self, request: ExecuteRequest) -> PreparedRequest:
        """Validate everything about a request; raises a 4xx ``RunnerError``."""
        language = self.languages.get(resolve_language(request.language))
        if language is None:
            offered = ", ".join(sorted(self.languages))
            aliases = ", ".join(
                f"{a}={n}" for a, n in LANGUAGE_ALIASES.items() if n in self.languages
            )
            raise UnsupportedLanguageError(
                f"language {request.language[:64]!r} is not offered (offered: {offered};"
                f" also accepted: {aliases})"
            )
        inline: list[InlineInput] = []
        names: set[str] = set()
        for item in request.inline_files:
            name = _workspace_path(item.name)
            try:
                content = base64.b64decode(item.content_b64, validate=True)
            except (binascii.Error, ValueError):
                raise BadRequestError(f"inline_files[{name}].content_b64: not base64") from None
            inline.append(InlineInput(name=name, content=content, executable=item.executable))
            names.add(name)
        refs = [
            FileRef(
                storage_session=ref.storage_session,
                object_id=ref.object_id,
                name=_workspace_path(ref.name),
                read_only=ref.read_only,
            )
            for ref in request.files
        ]
        for ref in refs:
            if ref.name in names:
                raise BadRequestError(f"files[{ref.name}]: also given as an inline file")
        _refuse_file_under_file(names | {ref.name for ref in refs})
        env = checked_env(request.env)
        for index, arg in enumerate(request.args):
            if "\x00" in arg:
                raise BadRequestError(f"args[{index}]: must not contain NUL")
        return PreparedRequest(
            request=request,
            language=language,
            inline_files=inline,
            refs=refs,
            limits=self.resolve_limits(request),
            env=env,
        )

    def resolve_limits(self, request: ExecuteRequest) -> JobLimits:
        """Request limits, defaulted and capped by configuration."""
        conf = self._settings.limits
        asked = request.limits
        return JobLimits(
            timeout_ms=min(request.timeout_ms, conf.max_timeout_ms),
            memory_bytes=min(
                (asked.memory_mib if asked and asked.memory_mib else conf.memory_mib),
                conf.max_memory_mib,
            )
            * MIB,
            pids=min(asked.pids if asked and asked.pids else conf.pids, conf.max_pids),
            stdout_bytes=min(
                asked.stdout_bytes if asked and asked.stdout_bytes else conf.stdout_bytes,
                conf.max_stdout_bytes,
            ),
            stderr_bytes=min(
                asked.stderr_bytes if asked and asked.stderr_bytes else conf.stderr_bytes,
                conf.max_stderr_bytes,
            ),
            file_size_mib=conf.file_size_mib,
            open_files=conf.open_files,
            tmp_mib=conf.tmp_mib,
        )

    def write_inputs(self, prepared: PreparedRequest, workspace: JobWorkspace) -> None:
        """Write the entry file and inline files (blocking: run in a thread)."""
        language = prepared.language
        # Over the emptied entry file a reused job directory kept (``entry.py``).
        write_entry(
            workspace.job_dir,
            language.entry_name,
            prepared.request.code.encode("utf-8"),
            mode=0o444,
        )
        for item in prepared.inline_files:
            try:
                st = fsops.write_file(
                    workspace.path,
                    item.name,
                    item.content,
                    mode=0o755 if item.executable else 0o644,
                    uid=workspace.uid,
                    gid=workspace.gid,
                )
            except fsops.UnsafePathError as exc:
                # The session's workspace has a directory, a link or a file in the way.
                raise InvalidPathError(
                    f"inline_files[{item.name}]: {exc.strerror or exc} in the workspace"
                ) from None
            workspace.surfaced[item.name] = SurfacedOutput(
                name=item.name,
                size=st.st_size,
                mtime_ns=st.st_mtime_ns,
                sha256=_sha256(item.content),
            )

    async def run_in(
        self,
        prepared: PreparedRequest,
        workspace: JobWorkspace,
        *,
        on_output: OutputCallback | None = None,
    ) -> ExecuteResult:
        """Run a prepared request in ``workspace`` (inputs already written)."""
        workspace_inside, job_inside = self._jail.inside_paths(workspace.path, workspace.job_dir)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workspace_inside,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            **prepared.env,
        }
        env.update(prepared.language.env(workspace_inside, env))
        argv = prepared.language.argv(prepared.request.args)
        if not self._jail.jailed:
            argv = [a.replace("/mnt/job", job_inside) for a in argv]
        spec = JobSpec(
            argv=argv,
            workspace=workspace.path,
            job_dir=workspace.job_dir,
            uid=workspace.uid,
            gid=workspace.gid,
            env=env,
            limits=prepared.limits,
            stdin=prepared.request.stdin.encode("utf-8")
            if prepared.request.stdin is not None
            else None,
            network=self._settings.allow_network,
        )
        outcome = await self._jail.run(spec, on_output=on_output)
        before = len(workspace.surfaced)
        # The disk is looked at (a statvfs) only for a job that failed: ``classify``
        # names a full disk only as the cause of a non-zero exit (or a signal), so a
        # job that exited 0 has no use for it. Why it pays: a statvfs of an image is
        # 4-5 us on the event loop (a timing loop, 2026-12-03), for every job that
        # succeeds. The three levers together: ``ImagePool._untouched`` (images.py).
        failed = outcome.exit_code != 0
        collected = await self._outputs.collect(
            workspace,
            disk_full=partial(self._workspaces.disk_full, workspace.path) if failed else None,
        )
        files = collected.files
        status = classify(outcome, disk_full=collected.disk_full)
        if status is RunStatus.INTERNAL_ERROR:
            log.error("jail failed to run a job: %s", outcome.jail_log or "no log")
        return ExecuteResult(
            status=status,
            exit_code=outcome.exit_code,
            signal=outcome.signal,
            stdout=outcome.stdout.decode("utf-8", "replace"),
            stderr=outcome.stderr.decode("utf-8", "replace"),
            stdout_truncated=outcome.stdout_truncated,
            stderr_truncated=outcome.stderr_truncated,
            wall_ms=outcome.wall_ms,
            cpu_ms=outcome.cpu_ms,
            max_rss_kib=outcome.max_rss_kib,
            files=files,
            session_id=workspace.session_id,
            workspace_changed=bool(files)
            or collected.removed > 0
            or len(workspace.surfaced) != before,
            output_scan_bytes=collected.scan_bytes,
            output_scan_exhausted=collected.exhausted,
            runner_cpu_ms=collected.cpu_ms + outcome.drain_cpu_ms,
        )

    async def collect_outputs(self, workspace: JobWorkspace) -> Collected:
        """New or changed files since ``workspace.surfaced``, bounded and accounted."""
        return await self._outputs.collect(workspace)


def classify(outcome: JobOutcome, *, disk_full: bool) -> RunStatus:
    """Name how a job ended from what was measured, never from a guess."""
    if outcome.timed_out:
        return RunStatus.TIMEOUT
    if outcome.stdout_limited:
        return RunStatus.OUTPUT_LIMIT
    if outcome.cgroup is not None and outcome.cgroup.oom_killed and outcome.exit_code != 0:
        return RunStatus.MEMORY_LIMIT
    if outcome.signal == "SIGXFSZ" or (disk_full and outcome.exit_code != 0):
        return RunStatus.DISK_LIMIT
    if outcome.exit_code == 0:
        return RunStatus.OK
    if outcome.exit_code is not None:
        if outcome.exit_code == 255 and "Launching child process failed" in outcome.jail_log:
            return RunStatus.INTERNAL_ERROR
        return RunStatus.ERROR
    if outcome.signal is not None:
        return RunStatus.SIGNALED
    return RunStatus.INTERNAL_ERROR


def _refuse_file_under_file(names: set[str]) -> None:
    """A request cannot make ``dir`` a file and ``dir/x`` a file under it (either order)."""
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in names:
                raise InvalidPathError(
                    f"inline_files: {parent[:200]!r} is given as a file and as the directory"
                    f" of {name[:200]!r}"
                )


def _workspace_path(name: str) -> str:
    try:
        return validate_workspace_path(name)
    except ProtocolError as exc:
        raise InvalidPathError(f"invalid file name {name[:200]!r}: {exc}") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


__all__ = ["Executor", "PreparedRequest", "classify"]
