"""sandcell's wire contract: versions, headers, messages, error codes, derivations.

The runner and the orchestrator both pin this package to the same version.
"""

from __future__ import annotations

from importlib.metadata import version as _dist_version

from . import headers, routes
from .codec import decode, decode_event, encode, encode_event, error_body
from .derivations import (
    checkpoint_key,
    input_cache_key,
    is_input_cache_key,
    is_runtime_session_id,
    runtime_session_id,
    validate_hint,
    validate_workspace_path,
)
from .errors import (
    ERROR_SEMANTICS,
    ErrorCode,
    ErrorSemantics,
    ProtocolError,
    ProtocolMismatchError,
    SandcellProtocolError,
)
from .messages import (
    CheckpointMeta,
    ErrorBody,
    ErrorDetail,
    ExecCall,
    ExecuteRequest,
    ExecuteResult,
    FileEntry,
    FileListing,
    FileRef,
    Health,
    InlineFile,
    InputManifest,
    InputObject,
    InputProbe,
    InputProbeResult,
    InputUploadResult,
    Language,
    Languages,
    Limits,
    OutputFile,
    PrimedInput,
    RestoreResult,
    ResultEvent,
    RunStatus,
    StderrEvent,
    StdoutEvent,
    StreamEvent,
    SurfacedOutput,
)
from .version import PROTOCOL_VERSION, check_compatible, parse_version

__version__ = _dist_version("sandcell-protocol")

__all__ = [
    "ERROR_SEMANTICS",
    "PROTOCOL_VERSION",
    "CheckpointMeta",
    "ErrorBody",
    "ErrorCode",
    "ErrorDetail",
    "ErrorSemantics",
    "ExecCall",
    "ExecuteRequest",
    "ExecuteResult",
    "FileEntry",
    "FileListing",
    "FileRef",
    "Health",
    "InlineFile",
    "InputManifest",
    "InputObject",
    "InputProbe",
    "InputProbeResult",
    "InputUploadResult",
    "Language",
    "Languages",
    "Limits",
    "OutputFile",
    "PrimedInput",
    "ProtocolError",
    "ProtocolMismatchError",
    "RestoreResult",
    "ResultEvent",
    "RunStatus",
    "SandcellProtocolError",
    "StderrEvent",
    "StdoutEvent",
    "StreamEvent",
    "SurfacedOutput",
    "__version__",
    "check_compatible",
    "checkpoint_key",
    "decode",
    "decode_event",
    "encode",
    "encode_event",
    "error_body",
    "headers",
    "input_cache_key",
    "is_input_cache_key",
    "is_runtime_session_id",
    "parse_version",
    "routes",
    "runtime_session_id",
    "validate_hint",
    "validate_workspace_path",
]
