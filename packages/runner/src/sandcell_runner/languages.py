"""The languages a runner offers: where each interpreter lives and how a job runs it.

Interpreters must sit on paths the jail mounts (``/usr``, ``/bin``): a pyenv shim
under ``/root`` is invisible inside the jail, and its ``.pth`` imports would add
~40 ms to every start even where visible, so the runner's own ``sys.executable``
is never used for jobs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

JOB_DIR = "/mnt/job"
"""Read-only mount holding the job's entry file, outside the workspace."""
WORKSPACE_DIR = "/mnt/data"
"""The workspace inside the jail: the job's working directory."""

# An interpreter that has ``-P`` (CPython 3.11+) runs the entry file itself, with the
# workspace put first on sys.path through PYTHONPATH instead of the file's directory
# (the read-only job directory). Why not a ``-c`` bootstrap that ``exec``s a compiled
# file: CPython's builtin ``compile()`` builds its ``_ast`` types on its first call
# (``PyAST_Check``), ~2.6 CPU-ms of a ~20 CPU-ms ``pass`` (timed outside the jail,
# 8 x 60 runs, 2026-12-07), where running a file parses and compiles it without them.
# The path entry is the workspace's absolute path where ``-c`` gives '' (the cwd): the
# two differ only for an import after an ``os.chdir``.
_SAFE_PATH_RE = re.compile(r"python(\d+)\.(\d+)$")

# For an interpreter without ``-P``: the working directory (the workspace) first on
# sys.path, as `python -c` does, while tracebacks still name the real entry file. An
# uncaught error is printed without this bootstrap's own frame (`File "<string>"`), so
# a traceback starts at the user's code, and exits 1 as python would.
_PYTHON_BOOTSTRAP = (
    "import sys;p=sys.argv[0]='{entry}'\n"
    "try:exec(compile(open(p,'rb').read(),p,'exec'),"
    "{{'__name__':'__main__','__file__':p,'__builtins__':__builtins__}})\n"
    "except (SystemExit,KeyboardInterrupt):raise\n"
    "except BaseException as e:\n"
    " e=e.with_traceback(e.__traceback__.tb_next)\n"
    " sys.excepthook(type(e),e,e.__traceback__);sys.exit(1)"
)


def has_safe_path(binary: str) -> bool:
    """Whether the CPython at ``binary`` takes ``-P``, by the version its real name
    carries (``/usr/bin/python3`` links to ``python3.11``); a name that says nothing
    counts as no, which only costs the slower bootstrap."""
    match = _SAFE_PATH_RE.search(os.path.basename(os.path.realpath(binary)))
    return match is not None and (int(match[1]), int(match[2])) >= (3, 11)


MOUNTED_PREFIXES = ("/usr/", "/bin/", "/lib/", "/lib64/", "/sbin/")

LANGUAGE_ALIASES = {
    "py": "python",
    "python3": "python",
    "javascript": "node",
    "js": "node",
    "nodejs": "node",
    "shell": "sh",
}
"""Other names callers use for an offered language (``ExecuteRequest.language``)."""


def resolve_language(name: str) -> str:
    """The offered language ``name`` means: itself, or what its alias stands for."""
    return LANGUAGE_ALIASES.get(name.lower(), name)


@dataclass(frozen=True, slots=True)
class LanguageSpec:
    """An interpreter found on this machine."""

    name: str
    binary: str
    entry_name: str
    version_flag: tuple[str, ...] = ()
    safe_path: bool = False
    """A Python that takes ``-P``: the entry file runs as itself (see ``env``)."""

    def argv(self, args: Sequence[str]) -> list[str]:
        """The command inside the jail for an entry file at ``JOB_DIR/entry_name``."""
        entry = f"{JOB_DIR}/{self.entry_name}"
        if self.name == "python":
            if self.safe_path:
                return [self.binary, "-u", "-P", entry, *args]
            return [self.binary, "-u", "-c", _PYTHON_BOOTSTRAP.format(entry=entry), *args]
        if self.name in _COMPILED:
            # Compiled into the job's own /tmp (a tmpfs inside the jail), then run with
            # the caller's args; a compile error is the job's stderr and exit code.
            script = f'out=$(mktemp) && {self.binary} -O2 -o "$out" "$0" -lm && exec "$out" "$@"'
            return ["/bin/sh", "-c", script, entry, *args]
        if self.name == "typescript":
            # Type stripping only (no type check), as node's own --experimental-strip-types
            # does; Debian's ts-node finds its modules under /usr/share/nodejs.
            return [_ENV, f"NODE_PATH={_DEBIAN_NODE_MODULES}", self.binary, "-T", entry, *args]
        return [self.binary, entry, *args]

    def env(self, workdir: str, env: Mapping[str, str]) -> dict[str, str]:
        """What the job's environment ``env`` needs for ``argv``, running in ``workdir``:
        for a ``-P`` Python, the working directory ahead of any PYTHONPATH the caller set,
        where ``python -c`` would put it."""
        if not self.safe_path:
            return {}
        given = env.get("PYTHONPATH")
        return {"PYTHONPATH": f"{workdir}:{given}" if given else workdir}


_CANDIDATES: dict[str, tuple[tuple[str, ...], str, list[str]]] = {
    "python": (("/usr/bin/python3", "/usr/local/bin/python3"), "main.py", ["--version"]),
    "bash": (("/usr/bin/bash", "/bin/bash"), "main.sh", ["--version"]),
    "sh": (("/usr/bin/sh", "/bin/sh", "/usr/bin/dash"), "main.sh", []),
    "node": (("/usr/bin/node", "/usr/local/bin/node"), "main.js", ["--version"]),
    # Debian's ts-node (package ts-node) on whichever node /usr/bin has.
    "typescript": (("/usr/bin/ts-node",), "main.ts", ["--version"]),
    # Not java: Debian's JDK reads its security policy from /etc, which the jail lacks.
    "c": (("/usr/bin/gcc",), "main.c", ["--version"]),
    "cpp": (("/usr/bin/g++",), "main.cpp", ["--version"]),
}
_COMPILED = frozenset({"c", "cpp"})
_ENV = "/usr/bin/env"
_DEBIAN_NODE_MODULES = "/usr/share/nodejs"

_VERSION_RE = re.compile(r"(\d+\.\d+(?:\.\d+)?)")


def _version_of(binary: str, flag: Sequence[str]) -> str:
    if not flag:
        real = os.path.realpath(binary)
        return Path(real).name
    try:
        out = subprocess.run(
            [binary, *flag],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            env={**os.environ, "NODE_PATH": _DEBIAN_NODE_MODULES},
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    match = _VERSION_RE.search(out.stdout + out.stderr)
    return match.group(1) if match else "unknown"


def discover_languages(*, jailed: bool = True) -> dict[str, LanguageSpec]:
    """Find each language's interpreter (run once at start-up; a few ``stat`` calls).

    Versions are not probed here: the ``--version`` runs (ts-node's alone starts
    node and loads TypeScript) took ~240 ms of a runner's ~400 ms of start-up, on
    the path of every cold session, for a figure only ``/v1/languages`` shows.
    ``LanguageVersions`` probes them when first asked.
    """
    found: dict[str, LanguageSpec] = {}
    for name, (candidates, entry, flag) in _CANDIDATES.items():
        for candidate in candidates:
            if jailed and not candidate.startswith(MOUNTED_PREFIXES):
                continue
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                found[name] = LanguageSpec(
                    name=name,
                    binary=candidate,
                    entry_name=entry,
                    version_flag=tuple(flag),
                    safe_path=name == "python" and has_safe_path(candidate),
                )
                break
        else:
            log.info("language %s not offered: no interpreter found", name)
    return found


class LanguageVersions:
    """The offered interpreters' versions, probed once, on first use, in parallel."""

    def __init__(self, languages: Mapping[str, LanguageSpec]) -> None:
        self._languages = dict(languages)
        self._versions: dict[str, str] | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> dict[str, str]:
        """Each offered language's version (``unknown`` where its probe failed)."""
        async with self._lock:
            if self._versions is None:
                self._versions = await asyncio.to_thread(self._probe)
            return self._versions

    def _probe(self) -> dict[str, str]:
        specs = list(self._languages.values())
        with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
            versions = pool.map(lambda spec: _version_of(spec.binary, spec.version_flag), specs)
            return {spec.name: version for spec, version in zip(specs, versions, strict=True)}
