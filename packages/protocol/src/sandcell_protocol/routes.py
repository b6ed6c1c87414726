"""Runner route paths. ``{path}`` segments are workspace paths (``validate_workspace_path``)."""

from __future__ import annotations

HEALTH = "/health"
LANGUAGES = "/v1/languages"
EXECUTE = "/v1/execute"
SESSION = "/v1/session"
SESSION_CHECKPOINT = "/v1/session/checkpoint"
SESSION_RESTORE = "/v1/session/restore"
SESSION_FILES = "/v1/session/files/{path:file_path}"
"""``file_path``: the runner's converter that matches any character, a newline too (a
file name may hold one); the path is then ``validate_workspace_path``'s."""
SESSION_FILES_PREFIX = "/v1/session/files/"
INPUTS_PROBE = "/v1/inputs/probe"
INPUTS = "/v1/inputs"
EGRESS = "/v1/egress"
"""GET: the sandbox's egress status; PUT an ``EgressPolicy``: replace it at once."""

SESSION_PROCESSES = "/v1/session/processes"
SESSION_RUNTIME_ERRORS = "/v1/session/runtime-errors"
SESSION_ANALYSIS = "/v1/session/analysis"
SESSION_PORTS_PREFIX = "/v1/session/ports/"

NDJSON = "application/x-ndjson"
GZIP = "application/gzip"
ZSTD = "application/zstd"

CHECKPOINT_META_MEMBER = ".sandcell-checkpoint.json"
"""Reserved archive member holding ``CheckpointMeta``; workspace members live under
``CHECKPOINT_WORKSPACE_PREFIX`` so no workspace path can collide with it."""
CHECKPOINT_WORKSPACE_PREFIX = "workspace"
