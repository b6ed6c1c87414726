"""Preview tokens: checked in constant time, and remembered (as digests) once deleted.

A preview URL carries its instance's token for the first visit (then a cookie).
A tab still open on a deleted instance learns that it is gone (404) rather than
that its token went bad (401): ``PreviewTokens`` keeps a digest of each deleted
instance's token, never the token itself, the newest ``kept`` of them.
"""

from __future__ import annotations

import collections
import hashlib
import hmac

from .instance import Instance

__all__ = ["PreviewTokens"]

_DELETED_PREVIEWS_KEPT = 4096


class PreviewTokens:
    """Which preview token opens which instance, and which opened a deleted one."""

    def __init__(self, *, kept: int = _DELETED_PREVIEWS_KEPT) -> None:
        self._kept = kept
        # Bounded, oldest out.
        self._deleted: collections.OrderedDict[str, None] = collections.OrderedDict()

    @staticmethod
    def opens(instance: Instance | None, token: str | None) -> bool:
        """Whether ``token`` is ``instance``'s preview token (constant time; None: no)."""
        expected = instance.preview_token if instance is not None else "x" * 43
        ok = hmac.compare_digest(expected.encode(), (token or "").encode())
        return ok and instance is not None

    def deleted(self, instance: Instance) -> None:
        """Remember that ``instance``'s token opened an instance now deleted."""
        self._deleted[_digest(instance.instance_id, instance.preview_token)] = None
        while len(self._deleted) > self._kept:
            self._deleted.popitem(last=False)

    def was_deleted(self, instance_id: str, token: str | None) -> bool:
        """Whether ``token`` was the preview token of ``instance_id`` before it was deleted."""
        return bool(token) and _digest(instance_id, token or "") in self._deleted


def _digest(instance_id: str, token: str) -> str:
    # Only a digest is kept: the token itself must not outlive its instance.
    return hashlib.sha256(f"{instance_id}\x00{token}".encode()).hexdigest()
