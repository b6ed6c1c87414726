"""Sandbox backends: the seam (``base``) and one module per backend.

    open_provider(settings.provider, answer_caps=settings.answer_caps)

Each backend is imported only when its settings are chosen, so the embedded
default never imports boto3 or a Docker client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..extras import needs_extra

if TYPE_CHECKING:
    from ..config import ProviderSettings
    from ..runner.answers import AnswerCaps
    from .base import SandboxProvider

__all__ = ["open_provider"]


def open_provider(
    settings: ProviderSettings, *, answer_caps: AnswerCaps | None = None
) -> SandboxProvider:
    """The provider ``settings`` configure (tagged by ``settings.kind``).

    ``answer_caps``: the ceiling of its runners' answers (``SANDCELL_ANSWER_*``); None:
    the defaults."""
    from ..runner.answers import DEFAULT_CAPS

    caps = answer_caps or DEFAULT_CAPS
    if settings.kind == "docker":
        from .docker import DockerProvider

        return DockerProvider(settings, answer_caps=caps)
    if settings.kind == "lambda-microvm":
        with needs_extra("aws", "SANDCELL_PROVIDER=lambda-microvm"):
            from .lambda_microvm import LambdaMicrovmProvider

        return LambdaMicrovmProvider(settings, answer_caps=caps)
    from .local import LocalProvider

    return LocalProvider(settings, answer_caps=caps)
