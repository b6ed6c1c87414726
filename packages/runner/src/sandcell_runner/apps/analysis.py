"""Static analysis of a session workspace, run inside the jail like any other job.

Checkers: ``ruff check`` (the runner's own ruff binary, bind-mounted read-only at
``/opt/sandcell/bin/ruff``: the jail sees only ``/usr``, ``/bin`` and ``/lib``), a
compile check by the jail's ``python3`` (``compile()`` over every ``*.py``: exact
line and column of each ``SyntaxError``), and ``tsc --noEmit`` when the workspace
has a ``tsconfig.json`` and ``tsc`` is found (``node_modules/.bin`` or ``PATH``).
A checker that cannot run is reported unavailable, with why, never as "no
findings". Files are reported workspace-relative, lines and columns 1-based.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandcell_protocol.app_messages import AnalysisResult, Diagnostic, ToolStatus

from ..config import MIB, RunnerSettings
from ..jail.nsjail import Jail
from ..jail.outcome import JobOutcome
from ..jail.spec import JobLimits, JobSpec
from ..workspace.manager import JobWorkspace

RUFF_INSIDE = "/opt/sandcell/bin/ruff"
_NO_TSC = "__sandcell_no_tsc__"
# Lint findings that fail at run time, not just in review.
_RUFF_ERRORS = ("E9", "F63", "F7", "F82")

_COMPILE_SCRIPT = """\
import json, os
SKIP = {"node_modules", "__pycache__", "venv", "site-packages", "dist", "build"}
out, seen = [], 0
for root, dirs, files in os.walk("."):
    dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
    for name in sorted(files):
        if not name.endswith(".py") or seen >= 5000:
            continue
        seen += 1
        path = os.path.join(root, name)[2:]
        try:
            with open(path, "rb") as f:
                compile(f.read(4000000), path, "exec", dont_inherit=True)
        except SyntaxError as e:
            out.append([path, e.lineno or 0, e.offset or 0, type(e).__name__, e.msg])
        except (ValueError, OSError) as e:
            out.append([path, 0, 0, type(e).__name__, str(e)])
print(json.dumps(out))
"""
_TSC_SCRIPT = f"""\
if [ -x node_modules/.bin/tsc ]; then exec node_modules/.bin/tsc --noEmit --pretty false; fi
if command -v tsc >/dev/null 2>&1; then exec tsc --noEmit --pretty false; fi
echo {_NO_TSC}; exit 127
"""
_TSC_LINE_RE = re.compile(r"^(.+?)\((\d+),(\d+)\): (error|warning|message) (TS\d+): (.*)$")
_TSC_GLOBAL_RE = re.compile(r"^(error|warning|message) (TS\d+): (.*)$")


def find_ruff() -> Path | None:
    """The runner's own ruff binary (beside its interpreter, else on PATH), if it has one."""
    candidates = [Path(sys.executable).parent / "ruff"]
    if on_path := shutil.which("ruff"):
        candidates.append(Path(on_path))
    for candidate in candidates:
        try:
            with candidate.open("rb") as binary:
                # A native binary: a script wrapper would need our venv inside the jail.
                if binary.read(4) == b"\x7fELF" and os.access(candidate, os.X_OK):
                    return candidate.resolve()
        except OSError:
            continue
    return None


@dataclass(frozen=True, slots=True)
class Checkers:
    """What this runner can offer: host path of ruff, jail paths of python3, node, bash."""

    ruff: Path | None
    python: str | None
    node: str | None
    bash: str


class Analyzer:
    """Runs the checkers as jobs in a session workspace (the caller holds the session lock)."""

    def __init__(self, settings: RunnerSettings, *, jail: Jail, checkers: Checkers) -> None:
        self._settings = settings
        self._jail = jail
        self._checkers = checkers

    async def analyse(self, workspace: JobWorkspace) -> AnalysisResult:
        diagnostics: list[Diagnostic] = []
        tools: list[ToolStatus] = []
        for check in (self._ruff, self._compile, self._tsc):
            found, status = await check(workspace)
            diagnostics += found
            tools.append(status)
        diagnostics.sort(key=lambda d: (d.file, d.line, d.column, d.tool))
        return AnalysisResult(diagnostics=diagnostics, tools=tools)

    async def _run(
        self, workspace: JobWorkspace, argv: list[str], *, timeout_s: int, memory_mib: int
    ) -> JobOutcome:
        conf = self._settings.limits
        inside, _ = self._jail.inside_paths(workspace.path, workspace.job_dir)
        ruff = self._checkers.ruff
        spec = JobSpec(
            argv=argv,
            workspace=workspace.path,
            job_dir=workspace.job_dir,
            uid=workspace.uid,
            gid=workspace.gid,
            env={
                "PATH": f"{os.path.dirname(RUFF_INSIDE)}:/usr/local/bin:/usr/bin:/bin",
                "HOME": inside,
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
                "NO_COLOR": "1",
            },
            limits=JobLimits(
                timeout_ms=min(timeout_s * 1000, conf.max_timeout_ms),
                memory_bytes=min(memory_mib, conf.max_memory_mib) * MIB,
                pids=min(128, conf.max_pids),
                stdout_bytes=16 * MIB,
                stderr_bytes=1 * MIB,
                file_size_mib=conf.file_size_mib,
                open_files=conf.open_files,
                tmp_mib=conf.tmp_mib,
            ),
            readonly_binds=[(ruff, RUFF_INSIDE)] if ruff and self._jail.jailed else [],
        )
        return await self._jail.run(spec)

    async def _ruff(self, workspace: JobWorkspace) -> tuple[list[Diagnostic], ToolStatus]:
        ruff = self._checkers.ruff
        if ruff is None:
            return [], ToolStatus(tool="ruff", available=False, detail="ruff is not installed")
        binary = RUFF_INSIDE if self._jail.jailed else str(ruff)
        argv = [binary, "check", "--no-cache", "--output-format", "json", "."]
        outcome = await self._run(workspace, argv, timeout_s=60, memory_mib=1024)
        inside, _ = self._jail.inside_paths(workspace.path, workspace.job_dir)
        if outcome.exit_code not in (0, 1):
            return [], _failed("ruff", outcome, f"exit code {outcome.exit_code}")
        try:
            found = [_ruff_diagnostic(item, inside) for item in json.loads(outcome.stdout)]
        except (ValueError, KeyError, TypeError) as exc:
            return [], _failed("ruff", outcome, str(exc))
        return found, ToolStatus(tool="ruff", available=True)

    async def _compile(self, workspace: JobWorkspace) -> tuple[list[Diagnostic], ToolStatus]:
        python = self._checkers.python
        if python is None:
            return [], ToolStatus(tool="python", available=False, detail="python3 not found")
        outcome = await self._run(
            workspace, [python, "-I", "-S", "-c", _COMPILE_SCRIPT], timeout_s=60, memory_mib=512
        )
        if outcome.exit_code != 0:
            return [], _failed("python", outcome, f"exit code {outcome.exit_code}")
        try:
            rows = json.loads(outcome.stdout)
            found = [
                Diagnostic(
                    file=str(path),
                    line=max(0, int(line)),
                    column=max(0, int(column)),
                    severity="error",
                    code=str(code),
                    message=str(message),
                    tool="python",
                )
                for path, line, column, code, message in rows
            ]
        except (ValueError, TypeError) as exc:
            return [], _failed("python", outcome, str(exc))
        return found, ToolStatus(tool="python", available=True)

    async def _tsc(self, workspace: JobWorkspace) -> tuple[list[Diagnostic], ToolStatus]:
        if not await asyncio.to_thread(_is_file, workspace.path / "tsconfig.json"):
            return [], ToolStatus(tool="tsc", available=False, detail="no tsconfig.json")
        if self._checkers.node is None:
            return [], ToolStatus(tool="tsc", available=False, detail="node is not installed")
        outcome = await self._run(
            workspace, [self._checkers.bash, "-c", _TSC_SCRIPT], timeout_s=180, memory_mib=2048
        )
        text = outcome.stdout.decode("utf-8", "replace")
        if outcome.exit_code == 127 and _NO_TSC in text:
            detail = "tsc not found (node_modules/.bin/tsc or PATH)"
            return [], ToolStatus(tool="tsc", available=False, detail=detail)
        found = _tsc_diagnostics(text)
        if outcome.exit_code != 0 and not found:
            return [], _failed("tsc", outcome, f"exit code {outcome.exit_code}")
        return found, ToolStatus(tool="tsc", available=True)


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _failed(tool: str, outcome: JobOutcome, reason: str) -> ToolStatus:
    if outcome.timed_out:
        why = "timed out"
    else:
        stderr = outcome.stderr.decode("utf-8", "replace").strip()[-400:]
        why = f"failed ({reason})" + (f": {stderr}" if stderr else "")
    return ToolStatus(tool=tool, available=False, detail=why)


def _relative(path: str, inside: str) -> str:
    prefix = inside.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def _ruff_diagnostic(item: dict[str, Any], inside: str) -> Diagnostic:
    code = item.get("code")
    location = item.get("location") or {}
    runtime = code in (None, "invalid-syntax") or str(code).startswith(_RUFF_ERRORS)
    return Diagnostic(
        file=_relative(str(item["filename"]), inside),
        line=int(location.get("row") or 0),
        column=int(location.get("column") or 0),
        severity="error" if runtime else "warning",
        code=str(code) if code is not None else None,
        message=str(item.get("message", "")),
        tool="ruff",
    )


def _tsc_diagnostics(text: str) -> list[Diagnostic]:
    found: list[Diagnostic] = []
    for raw in text.splitlines():
        if raw[:1].isspace() and found:
            last = found[-1]
            found[-1] = Diagnostic(
                file=last.file,
                line=last.line,
                column=last.column,
                severity=last.severity,
                code=last.code,
                message=f"{last.message}\n{raw.strip()}",
                tool="tsc",
            )
            continue
        file, line, column = "", "0", "0"
        if match := _TSC_LINE_RE.match(raw):
            file, line, column, severity, code, message = match.groups()
        elif match := _TSC_GLOBAL_RE.match(raw):
            severity, code, message = match.groups()
        else:
            continue
        found.append(
            Diagnostic(
                file=file,
                line=int(line),
                column=int(column),
                severity="info" if severity == "message" else severity,  # type: ignore[arg-type]
                code=code,
                message=message,
                tool="tsc",
            )
        )
    return found


__all__ = ["RUFF_INSIDE", "Analyzer", "Checkers", "find_ruff"]
