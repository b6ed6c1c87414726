"""The tenant digest: one derivation behind every tenant-scoped storage and registry key."""

from __future__ import annotations

import hashlib

from sandcell_orchestrator.e2b.kept import kept_prefix
from sandcell_orchestrator.e2b.saved import SavedSnapshots
from sandcell_orchestrator.sessions.owners import owners_prefix
from sandcell_orchestrator.tenants import tenant_digest

NAMESPACES = ["tenant-a", "", "ünï/cödé:with\nspaces and slashes"]


def test_the_digest_is_the_hex_sha256_of_the_namespace() -> None:
    """Objects and rows already stored are found by this digest: it must not change."""
    for namespace in NAMESPACES:
        assert tenant_digest(namespace) == hashlib.sha256(namespace.encode()).hexdigest()
    assert tenant_digest("tenant-a") == (
        "80a707af7dc77ee1228f9127180f3964835e5beb4c4ab0d812f0fe7593579b3a"
    )


def test_every_store_prefix_of_a_tenant_carries_the_same_digest() -> None:
    """The snapshot store's tenant prefixes (paused rows, session owners, E2B snapshots)
    all name the tenant by ``tenant_digest`` and nothing else."""
    for namespace in NAMESPACES:
        digest = tenant_digest(namespace)
        assert kept_prefix(namespace) == f"e2b/{digest}/"
        assert owners_prefix(namespace) == f"owners/{digest}/"
        assert SavedSnapshots.data_key(namespace, "i" * 20) == (
            f"e2b-snapshot-data/{digest}/{'i' * 20}"
        )
