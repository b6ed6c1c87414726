"""Input objects in the snapshot store (S3 / MinIO): the ``InputStore`` of a distributed setup.

With ``SANDCELL_SNAPSHOT_URL=s3://…`` every orchestrator process (every ``sandcell
serve`` worker) must see the same inputs: a file uploaded through one worker is
primed by a run on another. Objects live at ``inputs/<scoped storage_session>/<object_id>``
beside the checkpoints, written and read through the ``SnapshotStore`` (atomic
puts, size and sha256 checked on every read). Keys are opaque to S3: there is no
link to follow; both parts pass ``validate_input_ref`` before a key is formed,
and the scoped storage session keeps each tenant under its own prefix.
"""

from __future__ import annotations

from sandcell_protocol import FileRef, ProtocolError, validate_input_ref

from ..errors import InputMissingError
from ..snapshots import SnapshotNotFoundError, SnapshotStore
from ..snapshots.keys import KEY_COMPONENT
from ..snapshots.whole import put_whole, read_whole

__all__ = ["INPUTS_PREFIX", "SnapshotInputStore"]

INPUTS_PREFIX = "inputs"
DEFAULT_MAX_OBJECT_BYTES = 1 << 30


class SnapshotInputStore:
    """An ``InputStore`` over a ``SnapshotStore`` (used for S3; any store works)."""

    def __init__(
        self,
        store: SnapshotStore,
        *,
        prefix: str = INPUTS_PREFIX,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._max_object_bytes = max_object_bytes

    def __repr__(self) -> str:
        return f"SnapshotInputStore({self._store!r}, prefix={self._prefix!r})"

    def _key(self, storage_session: str, object_id: str) -> str | None:
        """The object's key; ``None`` for a valid ref no store key can name (so: absent)."""
        validate_input_ref(storage_session, object_id)
        # Store keys may not start with "-" (a valid ref part may): such a ref names
        # nothing that was ever written.
        if not (KEY_COMPONENT.fullmatch(storage_session) and KEY_COMPONENT.fullmatch(object_id)):
            return None
        return f"{self._prefix}/{storage_session}/{object_id}"

    async def read(self, ref: FileRef) -> bytes:
        data = await self.fetch(ref.storage_session, ref.object_id)
        if data is None:
            missing = f"input {ref.object_id} (for {ref.name}) not found"
            raise InputMissingError(missing, public_detail=missing)
        return data

    async def fetch(self, storage_session: str, object_id: str) -> bytes | None:
        key = self._key(storage_session, object_id)
        if key is None:
            return None
        try:
            return await read_whole(self._store, key, max_bytes=self._max_object_bytes)
        except SnapshotNotFoundError:
            return None

    async def write(self, storage_session: str, object_id: str, data: bytes) -> None:
        key = self._key(storage_session, object_id)
        if key is None:
            raise ProtocolError("object_id: must not start with '-' in this store")
        await put_whole(self._store, key, data, max_bytes=self._max_object_bytes)

    async def names(self, storage_session: str) -> list[str]:
        prefix = self._key(storage_session, "x")
        if prefix is None:
            return []
        directory = prefix[: -len("x")]
        return sorted(entry.key[len(directory) :] for entry in await self._store.list(directory))

    async def remove(self, storage_session: str, object_id: str) -> None:
        key = self._key(storage_session, object_id)
        if key is not None:
            await self._store.delete(key)
