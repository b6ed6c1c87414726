"""Errors of the app-instance API (the rest are the orchestrator's own).

As everywhere in serve, the message is for the log and ``public_detail`` is what
the caller may read (``routes.app_error`` answers with its own words plus that).

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
    """The request cannot be served as asked; ``code`` says how (``bad_request``, ...).

    The message describes only the caller's own request (built here from it, never
    from a runner's answer), so it is also the ``public_detail``.
    """

    def __init__(self, message: str, *, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message, public_detail=message)
        self.code = code


class InstanceNotFoundError(AppRequestError):
    """No instance of that id belongs to the caller (another tenant's looks the same)."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(f"no instance {instance_id[:80]!r}", code=ErrorCode.NOT_FOUND)


class InstanceStartError(SandcellError):
    """The template could not be brought up.

    ``said`` (the ``public_detail``) is which step failed and the app's own output
    tail: the caller's to read, it is their app. ``log_detail`` (what a runner said,
    which may name its routes) goes only into the message, for the log.
    """

    def __init__(self, said: str, *, log_detail: str | None = None) -> None:
        message = said if log_detail is None else f"{said} ({log_detail})"
        super().__init__(message, public_detail=said)
