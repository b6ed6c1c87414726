"""The tenant digest: how a namespace is named inside storage keys and registry keys.

A namespace is any text a key resolver returns; keys need a fixed, safe alphabet and
must not leak one tenant's name into a listing of another's prefix. Every key that is
scoped by tenant (the snapshot store's ``owners/``, ``e2b/``, ``e2b-snapshots/``,
``e2b-snapshot-data/``, ``e2b-snapshot-index/`` and ``e2b-metrics/`` prefixes,
Redis's ``nsids:``, ``ns:`` and ``e2b_ns*:`` keys)
carries this digest, so it must never change: objects and rows already stored are
found by it. This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import hashlib

__all__ = ["tenant_digest"]


def tenant_digest(namespace: str) -> str:
    """The hex sha256 of ``namespace`` (UTF-8): its name in tenant-scoped keys."""
    return hashlib.sha256(namespace.encode()).hexdigest()
