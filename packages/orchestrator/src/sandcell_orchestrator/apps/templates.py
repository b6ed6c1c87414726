"""App templates: a directory or git repository with a ``sandcell-template.toml``.

The manifest declares how an instance of the template is brought up::

    description = "A stdlib-only Python web app"
    preview_port = 8000            # the port /preview/<id>/ is proxied to
    live_reload = true             # optional: reload open tabs after a file write
                                   # (false when the app reloads itself)

    [install]                      # optional: run once, to completion, after copying
    command = "python3 -m compileall -q ."
    timeout_s = 120

    [start]                        # the dev server: a long-running process, PORT in its env
    command = "python3 dev.py"

    [ready]                        # when the instance counts as ready
    port = 8000                    # default: preview_port
    path = "/"                     # optional: an HTTP GET that must answer below 500
    timeout_s = 30

Unknown keys are errors, so a typo fails at load, not at run time. Git
templates are cloned on the orchestrator's host (sandboxes have no network)
into a temporary directory, read like a directory, then removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import anyio.to_thread
import msgspec

from sandcell_protocol import ProtocolError, validate_workspace_path

from ..errors import ConfigError, SandcellError
from ..to_the_end import to_the_end

__all__ = [
    "MANIFEST_NAME",
    "Template",
    "TemplateError",
    "TemplateFile",
    "TemplateManifest",
    "TemplateNotFoundError",
    "TemplateRegistry",
    "parse_manifest",
]

MANIFEST_NAME = "sandcell-template.toml"
MAX_TEMPLATE_FILES = 2000
MAX_TEMPLATE_BYTES = 64 << 20
_CLONE_TIMEOUT_S = 120.0
_SKIPPED_DIRS = frozenset({".git", "__pycache__", "node_modules"})

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=3600)]
Command = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class InstallStep(_Strict, frozen=True):
    """A command run to completion once the template's files are in place."""

    command: Command
    timeout_s: Seconds = 300.0


class StartStep(_Strict, frozen=True):
    """The dev server: started as a background process with ``PORT`` in its environment."""

    command: Command


class ReadyCheck(_Strict, frozen=True):
    """The instance is ready once ``port`` answers HTTP (``path`` with a status below 500)."""

    port: Port | None = None
    path: Annotated[str, msgspec.Meta(pattern=r"^/[^\s#]*$")] | None = None
    timeout_s: Seconds = 30.0


class TemplateManifest(_Strict, frozen=True):
    """A parsed ``sandcell-template.toml``."""

    start: StartStep
    preview_port: Port
    description: str = ""
    install: InstallStep | None = None
    ready: ReadyCheck = msgspec.field(default_factory=ReadyCheck)
    live_reload: bool = True
    """Reload an open preview tab after a file write (set false when the app's own
    dev tooling reloads its pages: Vite, webpack-dev-server, …)."""

    @property
    def ready_port(self) -> int:
        """The port the ready check probes (the preview port unless the manifest says)."""
        return self.ready.port if self.ready.port is not None else self.preview_port


@dataclass(frozen=True, slots=True)
class TemplateFile:
    """One file to copy into a new workspace."""

    path: str
    data: bytes
    mode: int

    def __repr__(self) -> str:
        return f"TemplateFile(path={self.path!r}, size={len(self.data)}, mode={self.mode:o})"


@dataclass(frozen=True, slots=True)
class Template:
    """A loaded template: its manifest and its files (the manifest among them)."""

    name: str
    manifest: TemplateManifest
    files: tuple[TemplateFile, ...]


class TemplateError(SandcellError):
    """A template could not be loaded (bad manifest, too big, clone failed).

    The message is for the operator's log: it may name a source directory, a clone
    URL or git's own words. The caller is told only that the template failed.
    """


class TemplateNotFoundError(TemplateError):
    """No template of that name is configured; the names that are, the caller may read."""

    def __init__(self, name: str, configured: Sequence[str]) -> None:
        said = f"{name[:64]!r} (configured: {', '.join(configured) or 'none'})"
        super().__init__(f"no template {said}", public_detail=said)


def parse_manifest(data: bytes, *, source: str = "template manifest") -> TemplateManifest:
    """Parse and validate a manifest; ``TemplateError`` names the problem."""
    try:
        return msgspec.toml.decode(data, type=TemplateManifest, strict=True)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise TemplateError(f"{source}: {exc}") from None


class TemplateRegistry:
    """Templates by name, from configured sources (directories or ``git+`` URLs)."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        for name, source in sources.items():
            if not source.startswith("git+") and not Path(source).is_absolute():
                raise ConfigError(f"template {name}: a directory source must be absolute")
        self._sources = dict(sources)

    def __repr__(self) -> str:
        return f"TemplateRegistry(names={self.names()})"

    def names(self) -> list[str]:
        """The configured template names, sorted."""
        return sorted(self._sources)

    async def load(self, name: str) -> Template:
        """Read template ``name`` (cloning it first when it is a git repository)."""
        source = self._sources.get(name)
        if source is None:
            raise TemplateNotFoundError(name, self.names())
        if not source.startswith("git+"):
            return await anyio.to_thread.run_sync(_read_directory, name, Path(source))
        url, _, ref = source[len("git+") :].partition("#")
        scratch = Path(await anyio.to_thread.run_sync(tempfile.mkdtemp, "", "sandcell-template-"))
        try:
            checkout = scratch / "checkout"
            await _clone(url, ref or None, checkout)
            return await anyio.to_thread.run_sync(_read_directory, name, checkout)
        finally:
            await anyio.to_thread.run_sync(shutil.rmtree, scratch, True)


async def _clone(url: str, ref: str | None, dest: Path) -> None:
    argv = ["git", "clone", "--quiet", "--depth", "1"]
    if ref is not None:
        argv += ["--branch", ref]
    argv += ["--", url, str(dest)]
    # No prompts, no user or system config: a clone must not pick up the host's credentials.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "HOME": str(dest.parent),
    }
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(_CLONE_TIMEOUT_S):
            _, stderr = await process.communicate()
    except BaseException as exc:
        # Timed out, or the caller was cancelled: a cancelled load left git cloning
        # on into the scratch directory its ``finally`` was removing.
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await to_the_end(process.wait())
        if isinstance(exc, TimeoutError):
            raise TemplateError(f"cloning the template took over {_CLONE_TIMEOUT_S:g}s") from None
        raise
    if process.returncode != 0:
        detail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise TemplateError(f"cloning the template failed: {detail[0][:300]}")


def _read_directory(name: str, root: Path) -> Template:
    manifest_path = root / MANIFEST_NAME
    try:
        manifest = parse_manifest(manifest_path.read_bytes(), source=f"template {name}")
    except OSError as exc:
        raise TemplateError(
            f"template {name}: cannot read {MANIFEST_NAME}: {exc.strerror}"
        ) from None
    files: list[TemplateFile] = []
    total = 0
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        for filename in sorted(names):
            path = Path(directory) / filename
            info = path.lstat()
            # Only regular files: a symlink in a template could point anywhere on the host.
            if not stat.S_ISREG(info.st_mode):
                continue
            relative = path.relative_to(root).as_posix()
            try:
                relative = validate_workspace_path(relative)
            except ProtocolError as exc:
                raise TemplateError(f"template {name}: {relative[:100]!r}: {exc}") from None
            total += info.st_size
            if len(files) >= MAX_TEMPLATE_FILES or total > MAX_TEMPLATE_BYTES:
                raise TemplateError(
                    f"template {name}: over {MAX_TEMPLATE_FILES} files or"
                    f" {MAX_TEMPLATE_BYTES >> 20} MiB"
                )
            mode = 0o755 if info.st_mode & 0o111 else 0o644
            files.append(TemplateFile(relative, path.read_bytes(), mode))
    return Template(name=name, manifest=manifest, files=tuple(files))
