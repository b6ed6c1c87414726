"""Optional backends and the extras that install their vendor SDKs.

The default install runs the embedded stack (local provider, in-process
registry, snapshot directory) with no vendor SDK at all. A backend chosen by
configuration imports its SDK when it is built; if the SDK is missing, the
``ConfigError`` names the extra that installs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .errors import ConfigError

__all__ = ["EXTRAS", "needs_extra"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "aws": ("boto3", "botocore"),
    "redis": ("redis",),
    "s3": ("minio", "urllib3"),
    "librechat": ("joserfc",),
    "e2b": ("e2b", "connectrpc", "protobuf", "pyqwest"),
}
"""Extra -> the top-level modules it provides (``sandcell-orchestrator[extra]``)."""


@contextlib.contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Turn a missing SDK of ``extra`` into a ``ConfigError`` saying how to install it.

    Any other import failure (a bug in sandcell, a broken install) is raised as it is.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in EXTRAS[extra]:
            raise
        raise ConfigError(
            f"{what} needs the {extra} extra ({missing} is not installed):"
            f" pip install 'sandcell-orchestrator[{extra}]'"
        ) from None
