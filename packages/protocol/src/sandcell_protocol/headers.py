"""HTTP header names both peers use. Compare case-insensitively on receipt."""

from __future__ import annotations

AUTHORIZATION = "Authorization"
"""``Bearer <token>``: the runner's per-sandbox token."""

RUNTIME_SESSION_ID = "X-Runtime-Session-Id"
"""Binds a request to a runner's session workspace."""

PROTOCOL = "X-Sandcell-Protocol"
"""Sent by the orchestrator on every call; the runner refuses another major."""

REQUEST_ID = "X-Request-Id"

AWS_PROXY_AUTH = "X-aws-proxy-auth"
"""Lambda MicroVM proxy token, minted by ``CreateMicrovmAuthToken``."""

CHECKPOINT_SHA256 = "X-Sandcell-Checkpoint-Sha256"
"""Hex sha256 of a checkpoint body, sent with a restore; a mismatch rejects it."""

CHECKPOINT_FROM = "X-Sandcell-Checkpoint-From"
"""The runtime session a restored checkpoint was taken of, when not the one it is
restored into (an E2B snapshot made into a new sandbox); the archive must name it."""

RETRY_AFTER = "Retry-After"

BEARER_PREFIX = "Bearer "

SECRET_HEADERS: frozenset[str] = frozenset({AUTHORIZATION.lower(), AWS_PROXY_AUTH.lower()})
"""Headers whose values must never reach a log line, an error or a repr."""
