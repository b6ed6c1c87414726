"""Message shapes on the wire. Frozen, strict: unknown fields and enum values fail."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

# Re-exported: the other message modules import these from here.
from .base import Message as Message
from .base import NonEmptyStr as NonEmptyStr
from .base import NonNegativeInt as NonNegativeInt
from .base import PositiveInt as PositiveInt
from .derivations import USER_ID_PATTERN
from .egress import EgressMechanism, EgressPolicy, EgressReason, EgressTransport
from .errors import ErrorCode
from .input_refs import INPUT_REF_PATTERN
from .limits import RunnerLimits

# "(?![\s\S])" rather than "$": "$" also matches before a trailing newline, and
# the lookahead reads the same in Python and ECMAScript (the JSON Schema's dialect).
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}(?![\s\S])")]
InputRefPart = Annotated[str, msgspec.Meta(pattern=INPUT_REF_PATTERN)]
"""A ``storage_session`` or ``object_id``; ``validate_input_ref`` checks the same rule."""
SessionHint = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,128}(?![\s\S])")]
UserId = Annotated[str, msgspec.Meta(pattern=USER_ID_PATTERN)]
"""A caller's user id; ``derivations.validate_user_id`` checks the same rule."""
SEGMENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}(?![\s\S])"
"""A caller's name that becomes a path segment of a route (a context id, a process tag).
It starts with a letter or a digit: "." and ".." would name another route once a client
or a proxy normalizes the path, and a leading "-" or "." reads as an option or a hidden
name wherever the name is shown."""
SEGMENT_NAME_RULE = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""``SEGMENT_NAME_PATTERN`` as error messages show it."""


class FileRef(Message, frozen=True):
    """An input object delivered by reference, primed into the workspace at ``name``."""

    storage_session: InputRefPart
    object_id: InputRefPart
    name: NonEmptyStr
    read_only: bool = False


class InlineFile(Message, frozen=True):
    """A small input file carried in the request body."""

    name: NonEmptyStr
    content_b64: str
    executable: bool = False


class Limits(Message, frozen=True):
    """Per-request limits; each is capped by the runner's configured maximum."""

    memory_mib: PositiveInt | None = None
    pids: PositiveInt | None = None
    stdout_bytes: PositiveInt | None = None
    stderr_bytes: PositiveInt | None = None


class ExecuteRequest(Message, frozen=True):
    """Run ``code`` in ``language``."""

    language: NonEmptyStr
    code: str
    args: list[str] = msgspec.field(default_factory=list)
    stdin: str | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)
    timeout_ms: PositiveInt = 30_000
    files: list[FileRef] = msgspec.field(default_factory=list)
    inline_files: list[InlineFile] = msgspec.field(default_factory=list)
    limits: Limits | None = None


class RunStatus(enum.StrEnum):
    """How an execution ended."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    OUTPUT_LIMIT = "output_limit"
    MEMORY_LIMIT = "memory_limit"
    DISK_LIMIT = "disk_limit"
    SIGNALED = "signaled"
    INTERNAL_ERROR = "internal_error"


class OutputFile(Message, frozen=True):
    """A file the job created or changed; ``content_b64`` only under the inline cap.

    A symlink is reported as one (``symlink_target`` set, ``size``/``sha256`` of the
    target string) and never read through. ``sha256`` is None for a file listed
    past the turn's output-scan budget (``ExecuteResult.output_scan_exhausted``):
    neither hashed nor inlined, it is offered again by a later turn.
    """

    name: str
    size: NonNegativeInt
    sha256: Sha256Hex | None
    content_b64: str | None = None
    symlink_target: str | None = None


class ExecuteResult(Message, frozen=True):
    """Outcome of one execution."""

    status: RunStatus
    exit_code: int | None
    signal: str | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_ms: NonNegativeInt
    """Wall time of the sandboxed run, the sandbox's own set-up included (a few ms)."""
    cpu_ms: NonNegativeInt
    """CPU time of the sandboxed run and every process in it, the sandbox's set-up included."""
    max_rss_kib: NonNegativeInt | None
    """The job's peak memory in KiB: what its cgroup was charged above the charge it
    started with (resident memory, tmpfs files it wrote, page cache it read in),
    the same quantity its memory limit counts. None where the runner cannot tell."""
    files: list[OutputFile]
    session_id: str | None = None
    workspace_changed: bool | None = None
    """Whether the job added, changed or removed a workspace file (None: not tracked).
    Lets the orchestrator skip the checkpoint of a turn that changed nothing."""
    output_scan_bytes: NonNegativeInt = 0
    """Bytes of output files the runner hashed for this turn (holes of sparse files
    included: hashing them costs the same; reading them does not happen)."""
    output_scan_exhausted: bool = False
    """The turn's output-scan budget (``SANDCELL_RUNNER_OUTPUT_SCAN_BYTES``) ran out:
    some files are listed unhashed (``sha256`` None), or the walk stopped early and
    removals were not reported."""
    runner_cpu_ms: NonNegativeInt = 0
    """CPU time the runner itself spent on this turn outside the jail: draining the
    job's output streams and scanning its output files. Not part of ``cpu_ms``."""
    durable: bool | None = None
    """Set by the orchestrator on a session turn: True when the turn's workspace is in
    a checkpoint (saved by this turn, or unchanged since the last one); False when its
    checkpoint failed (the store was down past the retry budget, or the sandbox went
    away): the turn lives only in its warm sandbox, and becomes durable when a later
    turn of the session saves, unless that sandbox is lost first. None: not a session
    turn (a stateless run, or the runner's own answer)."""


class StdoutEvent(Message, frozen=True, tag_field="type", tag="stdout"):
    """A chunk of the job's stdout, streamed as produced."""

    data: str


class StderrEvent(Message, frozen=True, tag_field="type", tag="stderr"):
    """A chunk of the job's stderr, streamed as produced."""

    data: str


class ResultEvent(Message, frozen=True, tag_field="type", tag="result"):
    """The last event of a stream: exactly one, after every output chunk."""

    result: ExecuteResult


EGRESS_EVENTS_SINCE = "1.2"
"""The protocol minor that added ``EgressRefusedEvent`` and ``EgressOmittedEvent``: a
runner streams them only to a peer whose ``X-Sandcell-Protocol`` is at least this."""

MAX_EGRESS_EVENTS_PER_TURN = 20
"""``egress_refused`` events one execute stream carries at most; the refusals past them
are counted in one ``egress_omitted`` event before the result."""


class EgressRefusedEvent(Message, frozen=True, tag_field="type", tag="egress_refused"):
    """A connection (or lookup) of this turn's job that the sandbox's egress policy
    refused, streamed as the runner's gateway decided it (protocol 1.2)."""

    reason: EgressReason
    transport: EgressTransport
    name: str | None = None
    """What the job asked for by name (a ``Host``, an SNI, a ``CONNECT`` target, a lookup)."""
    address: str | None = None
    """The address it went to (an IP literal, a transparent connection's destination)."""
    port: NonNegativeInt = 0
    at_ms: NonNegativeInt = 0
    """Wall-clock time of the decision (Unix epoch milliseconds)."""


class EgressOmittedEvent(Message, frozen=True, tag_field="type", tag="egress_omitted"):
    """Refusals of this turn past ``MAX_EGRESS_EVENTS_PER_TURN``, counted, not sent one by
    one (protocol 1.2); at most one per stream, just before the result."""

    count: PositiveInt


TurnEvent = StdoutEvent | StderrEvent | EgressRefusedEvent | EgressOmittedEvent
"""What a turn streams before its result: its output, and what egress refused."""
StreamEvent = StdoutEvent | StderrEvent | EgressRefusedEvent | EgressOmittedEvent | ResultEvent

HealthStatus = Literal["ok", "quarantined", "starting"]
WarmupState = Literal["none", "running", "done", "failed"]


class HealthSummary(Message, frozen=True):
    """``GET /health`` without a bearer token: what a load balancer needs, nothing more.

    Readiness (``status``) and the protocol (so a peer can refuse a mismatch); the
    bound session, languages, warnings and versions need the token (``Health``).
    """

    status: HealthStatus
    protocol: str


class Health(Message, frozen=True):
    """``GET /health`` with the bearer token: never carries a secret."""

    status: HealthStatus
    protocol: str
    runner_version: str
    session_id: str | None = None
    warmup: WarmupState = "none"
    languages: list[str] = msgspec.field(default_factory=list)
    warnings: list[str] = msgspec.field(default_factory=list)
    """Weakened isolation the operator should know of (no cgroups, no jail)."""
    egress: EgressMechanism = "none"
    """What enforces the egress policy; with ``none`` only ``deny_all`` can be set."""
    limits: RunnerLimits | msgspec.UnsetType = msgspec.UNSET
    """The runner's answer limits (``limits.py``), to a peer of protocol 1.3 or later;
    unset (absent from the JSON, which an older peer's strict decoding needs): an older
    runner, or an older peer."""


class Language(Message, frozen=True):
    """One language the runner offers."""

    name: str
    version: str
    contexts: bool = False
    """Whether stateful code contexts (``/v1/session/contexts``) run this language."""


class Languages(Message, frozen=True):
    """``GET /v1/languages``."""

    languages: list[Language]


class InputProbe(Message, frozen=True):
    """Which of these refs does the runner's input cache lack?"""

    refs: list[FileRef]


class InputProbeResult(Message, frozen=True):
    """The refs whose objects the cache lacks (the orchestrator pushes only these)."""

    missing: list[FileRef]


class InputObject(Message, frozen=True):
    """Object-level facts of a pushed input; never a file name."""

    size: NonNegativeInt
    sha256: Sha256Hex
    read_only: bool = False


class InputManifest(Message, frozen=True):
    """The ``manifest`` part of ``POST /v1/inputs``, keyed by ``input_cache_key``."""

    objects: dict[Sha256Hex, InputObject]


class InputUploadResult(Message, frozen=True):
    """Cache keys now present in the runner's cache."""

    stored: list[str]


class PrimedInput(Message, frozen=True):
    """A ref primed into the session workspace (checkpoint metadata)."""

    storage_session: str
    object_id: str
    name: str
    read_only: bool
    sha256: Sha256Hex


class SurfacedOutput(Message, frozen=True):
    """A file already returned to the caller, for output diffing across turns."""

    name: str
    size: NonNegativeInt
    mtime_ns: int
    sha256: Sha256Hex


class CheckpointMeta(Message, frozen=True):
    """The reserved metadata member of a checkpoint archive."""

    session_id: str
    protocol: str
    primed_inputs: list[PrimedInput] = msgspec.field(default_factory=list)
    surfaced_outputs: list[SurfacedOutput] = msgspec.field(default_factory=list)
    skipped: list[str] = msgspec.field(default_factory=list)
    """Workspace entries not exported (FIFOs, sockets, devices)."""
    contexts: dict[str, str] = msgspec.field(default_factory=dict)
    """The session's code contexts (id -> language). Their variables are not in the
    archive: a runner restoring it knows them as lost, so a run answers
    ``context_lost`` instead of running in a silently empty namespace."""


class FileEntry(Message, frozen=True):
    """One entry of a session workspace listing; symlinks are reported, never followed."""

    name: str
    kind: Literal["file", "dir", "symlink", "other"]
    size: NonNegativeInt
    mtime_ns: int
    mode: NonNegativeInt
    symlink_target: str | None = None


class FileListing(Message, frozen=True):
    """``GET /v1/session/files/{dir}``: the directory's direct entries."""

    path: str
    entries: list[FileEntry]


class RestoreResult(Message, frozen=True):
    """``POST /v1/session/restore``: what the restored workspace holds."""

    session_id: str
    files: NonNegativeInt
    bytes: NonNegativeInt


class ErrorDetail(Message, frozen=True):
    """The inner object of an ``ErrorBody``."""

    code: ErrorCode
    message: str
    retryable: bool


class ErrorBody(Message, frozen=True):
    """Every non-2xx answer: ``{"error": {code, message, retryable}}``."""

    error: ErrorDetail


class ExecCall(ExecuteRequest, frozen=True, kw_only=True):
    """``POST /v1/exec`` of the orchestrator's service: a request plus who and which session."""

    user_id: UserId
    runtime_session_hint: SessionHint | None = None
    egress: EgressPolicy | None = None
    """The sandbox's egress policy from this turn on (None: leave it as it is)."""


ALL_MESSAGES: tuple[type[Message], ...] = (
    FileRef,
    InlineFile,
    Limits,
    ExecuteRequest,
    OutputFile,
    ExecuteResult,
    StdoutEvent,
    StderrEvent,
    ResultEvent,
    EgressRefusedEvent,
    EgressOmittedEvent,
    Health,
    HealthSummary,
    RunnerLimits,
    Language,
    Languages,
    InputProbe,
    InputProbeResult,
    InputObject,
    InputManifest,
    InputUploadResult,
    PrimedInput,
    SurfacedOutput,
    CheckpointMeta,
    FileEntry,
    FileListing,
    RestoreResult,
    ErrorDetail,
    ErrorBody,
    ExecCall,
)
