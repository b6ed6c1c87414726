"""Wire shapes of a session's sandbox features: interactive processes and filesystem calls.

These are the runner routes an envd-style API (E2B's, served by the orchestrator)
sits on: processes started with any argv, optional stdin and a pseudo-terminal
allocated inside the jail, addressed by a runner-assigned ``pid`` (never a host
pid) or a tag, whose output is streamed as NDJSON events; and filesystem calls
on the session workspace. Frozen and strict like ``messages.py``.

Paths. A sandbox client names files as the sandbox user sees them: relative to
the home directory ``/home/user`` or absolute under it. ``sandbox_path`` is the
one function that turns such a name into a workspace path (``""`` is the home
directory itself); anything outside the home directory is refused.
"""

from __future__ import annotations

import posixpath
from typing import Annotated, Literal

import msgspec

from .derivations import validate_workspace_path
from .errors import ProtocolError
from .messages import Message, NonNegativeInt, PositiveInt

SANDBOX_HOME = "/home/user"
"""Where the session workspace appears to a sandbox's processes (and its clients)."""

SESSION_SANDBOX = "/v1/session/sandbox"
SANDBOX_PROCESSES = SESSION_SANDBOX + "/processes"
SANDBOX_PROCESS = SANDBOX_PROCESSES + "/{pid:int}"
SANDBOX_PROCESS_EVENTS = SANDBOX_PROCESS + "/events"
SANDBOX_PROCESS_INPUT = SANDBOX_PROCESS + "/input"
SANDBOX_PROCESS_CLOSE_STDIN = SANDBOX_PROCESS + "/close-stdin"
SANDBOX_PROCESS_SIGNAL = SANDBOX_PROCESS + "/signal"
SANDBOX_PROCESS_PTY = SANDBOX_PROCESS + "/pty"
SANDBOX_FS = SESSION_SANDBOX + "/fs"
"""``POST`` a ``FsRequest``; answered by an ``FsResult``."""
SANDBOX_METRICS = SESSION_SANDBOX + "/metrics"
"""``POST`` a ``MetricsQuery``; answered by ``SandboxMetrics``."""

PROCESS_TAG_MAX = 256
MAX_PTY_SIDE = 1000

SandboxPid = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
PtySide = Annotated[int, msgspec.Meta(ge=1, le=MAX_PTY_SIDE)]
SignalName = Literal["SIGTERM", "SIGKILL", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"]
OutputStream = Literal["stdout", "stderr", "pty"]


def sandbox_path(name: str) -> str:
    """The workspace path of a sandbox path (``""``: the home directory itself).

    Accepts ``/home/user``, ``/home/user/…``, ``~/…`` and paths relative to the home
    directory; raises ``ProtocolError`` for anything else (``/etc``, ``..`` escapes).
    """
    if not isinstance(name, str) or not name:
        raise ProtocolError("path: must be a non-empty string")
    if name == "~" or name.startswith("~/"):
        name = SANDBOX_HOME + name[1:]
    if name.startswith("/"):
        if "\x00" in name:
            raise ProtocolError("path: must not contain NUL")
        normal = posixpath.normpath(name)
        if normal == SANDBOX_HOME:
            return ""
        if not normal.startswith(SANDBOX_HOME + "/"):
            raise ProtocolError(f"path: only {SANDBOX_HOME} and below are served")
        name = normal[len(SANDBOX_HOME) + 1 :]
    if all(part in ("", ".") for part in name.split("/")):
        return ""
    return validate_workspace_path(name)


def sandbox_display_path(workspace_path: str) -> str:
    """The sandbox path (``/home/user/…``) of a workspace path."""
    return SANDBOX_HOME if workspace_path in ("", ".") else f"{SANDBOX_HOME}/{workspace_path}"


# -- processes ------------------------------------------------------------------


class PtySize(Message, frozen=True, kw_only=True):
    """A pseudo-terminal's size in character cells."""

    cols: PtySide
    rows: PtySide


class SandboxProcessStart(Message, frozen=True, kw_only=True):
    """``POST /v1/session/sandbox/processes``: start ``cmd args…`` in the session's jail.

    Answered with a stream of ``ProcessEvent`` lines (NDJSON), the first a
    ``ProcessStarted``. The process outlives the stream: closing it does not stop
    the process. ``cwd`` is a sandbox path (``sandbox_path``). With ``pty`` the
    process runs on a pseudo-terminal made inside the jail (stdout and stderr both
    arrive as ``pty`` output; input goes to the terminal).
    """

    cmd: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    args: list[str] = msgspec.field(default_factory=list)
    envs: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str | None = None
    tag: Annotated[str, msgspec.Meta(min_length=1, max_length=PROCESS_TAG_MAX)] | None = None
    stdin: bool = False
    pty: PtySize | None = None
    timeout_ms: PositiveInt | None = None
    """Stopped (TERM, then KILL) this long after it started; None: runs until it ends."""


class SandboxProcessInfo(Message, frozen=True, kw_only=True):
    """A running process of the session, as started."""

    pid: SandboxPid
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None = None
    tag: str | None = None
    pty: bool = False


class SandboxProcessList(Message, frozen=True, kw_only=True):
    """``GET /v1/session/sandbox/processes``: the processes still running."""

    processes: list[SandboxProcessInfo]


class ProcessStarted(Message, frozen=True, kw_only=True, tag="start"):
    """First event of a stream: the process's pid."""

    pid: SandboxPid


class ProcessOutput(Message, frozen=True, kw_only=True, tag="data"):
    """Output as it was produced (``data`` is base64: output is bytes, not text)."""

    stream: OutputStream
    data: str


class ProcessEnded(Message, frozen=True, kw_only=True, tag="end"):
    """Last event: how the process ended.

    ``exit_code`` is set when it exited by itself; ``signal`` when a signal ended
    it. ``status`` reads like envd's (``exit status 1``, ``signal: killed``).
    """

    exit_code: int | None
    signal: SignalName | str | None = None
    status: str
    error: str | None = None


class ProcessKeepalive(Message, frozen=True, kw_only=True, tag="keepalive"):
    """Sent while a process is quiet, so proxies and clients keep the stream open."""


ProcessEvent = ProcessStarted | ProcessOutput | ProcessEnded | ProcessKeepalive


class ProcessSignal(Message, frozen=True, kw_only=True):
    """``POST …/processes/{pid}/signal``."""

    signal: SignalName


class PtyResize(Message, frozen=True, kw_only=True):
    """``POST …/processes/{pid}/pty``: resize the process's terminal."""

    size: PtySize


# -- filesystem -------------------------------------------------------------------

EntryType = Literal["file", "dir", "symlink", "other"]


class EntryInfo(Message, frozen=True, kw_only=True):
    """One filesystem entry; ``path`` is its sandbox path. Symlinks are never followed."""

    name: str
    type: EntryType
    path: str
    size: NonNegativeInt
    mode: NonNegativeInt
    permissions: str
    owner: str
    group: str
    modified_time_ns: int
    symlink_target: str | None = None


class FsStat(Message, frozen=True, kw_only=True, tag="stat"):
    path: str


class FsMakeDir(Message, frozen=True, kw_only=True, tag="make_dir"):
    """Create the directory and its parents; ``created`` false if it already existed."""

    path: str


class FsMove(Message, frozen=True, kw_only=True, tag="move"):
    source: str
    destination: str


class FsListDir(Message, frozen=True, kw_only=True, tag="list_dir"):
    """Entries of ``path`` down to ``depth`` levels (1: the direct entries)."""

    path: str
    depth: PositiveInt = 1


class FsRemove(Message, frozen=True, kw_only=True, tag="remove"):
    path: str


class FsSnapshot(Message, frozen=True, kw_only=True, tag="snapshot"):
    """Every entry under ``path`` (``recursive``) with its size and mtime: what a
    watcher compares between two polls."""

    path: str
    recursive: bool = False


FsRequest = FsStat | FsMakeDir | FsMove | FsListDir | FsRemove | FsSnapshot


class FsResult(Message, frozen=True, kw_only=True):
    """The answer to an ``FsRequest``: ``entry`` (stat, make_dir, move), ``entries``
    (list_dir, snapshot) or neither (remove)."""

    entry: EntryInfo | None = None
    entries: list[EntryInfo] | None = None
    created: bool | None = None


# -- metrics --------------------------------------------------------------------


class MetricsQuery(Message, frozen=True, kw_only=True):
    """``POST /v1/session/sandbox/metrics``: the session's samples taken in
    ``[start_s, end_s]`` (unix seconds; None: unbounded on that side)."""

    start_s: NonNegativeInt | None = None
    end_s: NonNegativeInt | None = None


class MetricsSample(Message, frozen=True, kw_only=True):
    """What the runner saw of its session's jobs and processes at one instant."""

    at_s: float
    """When (unix seconds, the runner's clock)."""
    cpu_count: PositiveInt
    """CPUs the session may use: its CPU quota, rounded up (the host's CPUs without one)."""
    cpu_used_pct: Annotated[float, msgspec.Meta(ge=0, le=100)]
    """Of ``cpu_count``, used since the sample before (0 in the first)."""
    mem_used_bytes: NonNegativeInt
    """Charged to the session's cgroups, inactive file cache left out."""
    mem_cache_bytes: NonNegativeInt
    mem_total_bytes: NonNegativeInt
    """The memory limit of each of its jobs and processes."""
    disk_used_bytes: NonNegativeInt
    disk_total_bytes: NonNegativeInt
    """The workspace's size (its quota)."""


class SandboxMetrics(Message, frozen=True, kw_only=True):
    """The samples asked for, oldest first; the runner keeps a bounded number."""

    interval_s: PositiveInt
    samples: list[MetricsSample]


_event_decoder = msgspec.json.Decoder(ProcessEvent)
_fs_decoder = msgspec.json.Decoder(FsRequest)


def decode_process_event(line: bytes | str) -> ProcessEvent:
    """One NDJSON line of a process stream (``ProtocolError`` if invalid)."""
    try:
        return _event_decoder.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"ProcessEvent: {exc}") from exc


def decode_fs_request(body: bytes | str) -> FsRequest:
    """The body of ``POST /v1/session/sandbox/fs`` (``ProtocolError`` if invalid)."""
    try:
        return _fs_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"FsRequest: {exc}") from exc


__all__ = [
    "MAX_PTY_SIDE",
    "PROCESS_TAG_MAX",
    "SANDBOX_FS",
    "SANDBOX_HOME",
    "SANDBOX_METRICS",
    "SANDBOX_PROCESS",
    "SANDBOX_PROCESSES",
    "SANDBOX_PROCESS_CLOSE_STDIN",
    "SANDBOX_PROCESS_EVENTS",
    "SANDBOX_PROCESS_INPUT",
    "SANDBOX_PROCESS_PTY",
    "SANDBOX_PROCESS_SIGNAL",
    "SESSION_SANDBOX",
    "EntryInfo",
    "EntryType",
    "FsListDir",
    "FsMakeDir",
    "FsMove",
    "FsRemove",
    "FsRequest",
    "FsResult",
    "FsSnapshot",
    "FsStat",
    "MetricsQuery",
    "MetricsSample",
    "OutputStream",
    "ProcessEnded",
    "ProcessEvent",
    "ProcessKeepalive",
    "ProcessOutput",
    "ProcessSignal",
    "ProcessStarted",
    "PtyResize",
    "PtySize",
    "SandboxMetrics",
    "SandboxPid",
    "SandboxProcessInfo",
    "SandboxProcessList",
    "SandboxProcessStart",
    "SignalName",
    "decode_fs_request",
    "decode_process_event",
    "sandbox_display_path",
    "sandbox_path",
]
