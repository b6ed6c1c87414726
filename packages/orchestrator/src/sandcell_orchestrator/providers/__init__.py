"""Sandbox backends: the seam (``base``) and one module per backend.

    open_provider(settings.provider)      # LocalSettings | DockerSettings | ...

Each backend is imported only when its settings are chosen, so the embedded
default never imports boto3 or a Docker client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..extras import needs_extra

if TYPE_CHECKING:
    from ..config import ProviderSettings
    from .base import SandboxProvider

__all__ = ["open_provider"]


def open_provider(settings: ProviderSettings) -> SandboxProvider:
    """The provider ``settings`` configure (tagged by ``settings.kind``)."""
    if settings.kind == "docker":
        from .docker import DockerProvider

        return DockerProvider(settings)
    if settings.kind == "lambda-microvm":
        with needs_extra("aws", "SANDCELL_PROVIDER=lambda-microvm"):
            from .lambda_microvm import LambdaMicrovmProvider

        return LambdaMicrovmProvider(settings)
    from .local import LocalProvider

    return LocalProvider(settings)
