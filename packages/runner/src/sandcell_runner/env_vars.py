"""A job's environment variables checked by the protocol's one rule, as a 400 here."""

from __future__ import annotations

from collections.abc import Mapping

from sandcell_protocol import ProtocolError
from sandcell_protocol.env_vars import validate_env

from .errors import BadRequestError

__all__ = ["checked_env"]


def checked_env(env: Mapping[str, str], *, field: str = "env") -> dict[str, str]:
    """A copy of ``env``; ``BadRequestError`` naming the first bad variable."""
    try:
        return validate_env(env, field=field)
    except ProtocolError as exc:
        raise BadRequestError(str(exc)) from None
