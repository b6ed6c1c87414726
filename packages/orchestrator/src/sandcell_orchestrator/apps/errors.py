"""Errors of the app-instance API (the rest are the orchestrator's own).

SandcellError
├── AppRequestError          the caller's request is wrong; ``code`` is the protocol's ErrorCode
│   ├── InstanceNotFoundError no such instance in the caller's namespace (or it was shut down)
│   └── WebhookTargetError   (webhook_targets.py) a webhook_url the service will not call
├── InstanceStartError       the template's install, start or ready check failed
├── CommandDeniedError       (policy.py) a command matched a policy rule; nothing ran
└── TemplateError            (templates.py) a template could not be loaded
    └── TemplateNotFoundError
"""

from __future__ import annotations

from sandcell_protocol import ErrorCode

from ..errors import SandcellError

__all__ = ["AppRequestError", "InstanceNotFoundError", "InstanceStartError"]


class AppRequestError(SandcellError):
    """The request cannot be served as asked; ``code`` says how (``bad_request``, ...)."""

    def __init__(self, message: str, *, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class InstanceNotFoundError(AppRequestError):
    """No instance of that id belongs to the caller (another tenant's looks the same)."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(f"no instance {instance_id[:80]!r}", code=ErrorCode.NOT_FOUND)


class InstanceStartError(SandcellError):
    """The template could not be brought up; the message carries the output's tail."""
