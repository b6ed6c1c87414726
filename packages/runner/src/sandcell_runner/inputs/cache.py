"""The runner's input cache: pushed (or pulled) input objects, keyed by ``input_cache_key``.

The cache is one directory, mode 0700, owned by the runner's user, outside every
workspace and jail mount (the caller chooses where). It holds object-level facts only,
never a file name; a ref's name matters only when priming copies an object into a
workspace. Layout::

    <key>        the object's bytes
    <key>.json   its InputObject (size, sha256, read_only): the commit marker
    .tmp-*       staging files of uploads and pulls in flight

An entry is present only when both files exist, the sidecar decodes and the object's size
agrees with it. Commits remove an old sidecar first, rename the object, then rename the
sidecar, so a crash at any step leaves either the old entry, no entry or the new one.
One process owns a cache directory: a lock in this object serialises commits and reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import anyio

from sandcell_protocol import (
    FileRef,
    InputObject,
    ProtocolError,
    decode,
    encode,
    input_cache_key,
    is_input_cache_key,
    validate_input_ref,
)

from ..errors import BadRequestError, ConfigError, InputMissingError, PayloadTooLargeError
from .file_server import check_response, describe, map_pull_errors, split_credentials
from .upload import TEMP_PREFIX, StagedObject, StagingFile, receive_upload

SIDECAR_SUFFIX = ".json"
_MAX_SIDECAR_BYTES = 4096
_HASH_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class CachedObject:
    """A present cache entry: read its bytes from ``path``.

    ``read_only`` is what the object was stored with (its first push or pull); a ref that
    names the object again may ask otherwise, so priming should follow the ref.
    """

    key: str
    path: Path
    size: int
    sha256: str
    read_only: bool


@dataclass
class _KeyGuard:
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 0


def _key_of(ref: FileRef) -> str:
    # Every ref the runner acts on passes here first (probe, execute, pull), so a
    # value the protocol refuses never becomes a cache key or a pull URL.
    try:
        validate_input_ref(ref.storage_session, ref.object_id)
        return input_cache_key(ref.storage_session, ref.object_id)
    except ProtocolError as exc:
        raise BadRequestError(f"{describe(ref)}: {exc}") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class InputCache:
    """Object-keyed input cache of one runner; see the module docstring for the layout.

    Construct it at start-up: the constructor creates (or tightens) ``root`` and sweeps
    crash leftovers, blocking. ``missing``, ``verify`` and ``discard`` touch the disk and
    block too: from async code, call them through ``anyio.to_thread.run_sync``. ``ingest``
    and ``resolve`` do their disk work in worker threads themselves.
    """

    def __init__(
        self,
        root: Path,
        *,
        max_object_bytes: int,
        file_server_url: str | None = None,
        http_timeout_s: float = 30,
    ) -> None:
        if max_object_bytes < 0:
            raise ValueError("max_object_bytes must not be negative")
        self._root = root
        self._max_object_bytes = max_object_bytes
        self._file_server_url: str | None = None
        self._file_server_auth: tuple[str, str] | None = None
        if file_server_url:
            self._file_server_url, self._file_server_auth = split_credentials(
                file_server_url.rstrip("/")
            )
        self._http_timeout_s = http_timeout_s
        self._lock = threading.Lock()
        self._pulls: dict[str, _KeyGuard] = {}
        self._prepare_root()

    @property
    def root(self) -> Path:
        """The cache directory."""
        return self._root

    def _prepare_root(self) -> None:
        self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(self._root)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise ConfigError(
                f"input cache {self._root} must be a directory owned by uid {os.geteuid()}"
            )
        # mkdir's mode is filtered by the umask and ignored for an existing directory.
        os.chmod(self._root, 0o700)
        with os.scandir(self._root) as entries:
            names = {entry.name for entry in entries}
        # Leftovers of a crash: staging files, and halves of an interrupted commit.
        for name in names:
            base = name.removesuffix(SIDECAR_SUFFIX)
            orphan = is_input_cache_key(base) and (
                (name == base and base + SIDECAR_SUFFIX not in names)
                or (name != base and base not in names)
            )
            if name.startswith(TEMP_PREFIX) or orphan:
                (self._root / name).unlink(missing_ok=True)

    def _object_path(self, key: str) -> Path:
        # Every path in the cache is built here, so nothing unchecked names a file.
        if not is_input_cache_key(key):
            raise BadRequestError(f"{key[:80]!r} is not an input cache key")
        return self._root / key

    def _sidecar_path(self, key: str) -> Path:
        return self._object_path(key).with_name(key + SIDECAR_SUFFIX)

    def _read_facts(self, key: str) -> InputObject | None:
        """The entry's facts if it is present and consistent; call with the lock held."""
        try:
            with self._sidecar_path(key).open("rb") as sidecar:
                raw = sidecar.read(_MAX_SIDECAR_BYTES + 1)
            info = os.lstat(self._object_path(key))
        except OSError:
            return None
        if len(raw) > _MAX_SIDECAR_BYTES:
            return None
        try:
            facts = decode(raw, InputObject)
        except ProtocolError:
            return None
        if not stat.S_ISREG(info.st_mode) or info.st_size != facts.size:
            return None
        return facts

    def _entry(self, key: str, facts: InputObject) -> CachedObject:
        return CachedObject(key, self._object_path(key), facts.size, facts.sha256, facts.read_only)

    def _lookup(self, key: str) -> CachedObject | None:
        with self._lock:
            facts = self._read_facts(key)
        return None if facts is None else self._entry(key, facts)

    def _remove(self, key: str) -> None:
        # Sidecar first: the entry stops being present before its bytes go.
        self._sidecar_path(key).unlink(missing_ok=True)
        self._object_path(key).unlink(missing_ok=True)

    def _write_sidecar(self, facts: InputObject) -> Path:
        sidecar = StagingFile(self._root)
        try:
            sidecar.write(encode(facts))
            sidecar.finish()
        except BaseException:
            sidecar.discard()
            raise
        return sidecar.path

    def _commit(self, staged: list[StagedObject]) -> None:
        """Move verified staging files into place, all or none (blocking)."""
        pending = {item.key: item.temp_path for item in staged}
        sidecars: dict[str, Path] = {}
        try:
            for item in staged:
                sidecars[item.key] = self._write_sidecar(item.facts)
            with self._lock:
                touched: list[str] = []
                try:
                    for item in staged:
                        if self._read_facts(item.key) == item.facts:
                            continue  # already present as uploaded; keep the old inode
                        touched.append(item.key)
                        self._sidecar_path(item.key).unlink(missing_ok=True)
                        os.replace(pending.pop(item.key), self._object_path(item.key))
                        os.replace(sidecars.pop(item.key), self._sidecar_path(item.key))
                    if touched:
                        _fsync_dir(self._root)
                except BaseException:
                    # An entry this batch replaced cannot be restored; absent is safe
                    # (the next probe reports it and the orchestrator pushes it again).
                    for key in touched:
                        self._remove(key)
                    raise
        finally:
            for path in (*pending.values(), *sidecars.values()):
                path.unlink(missing_ok=True)

    def missing(self, refs: list[FileRef]) -> list[FileRef]:
        """The refs whose objects are not in the cache, in order (blocking).

        Every such ref is returned, including several refs to one object, so the
        caller can answer ``InputProbeResult`` as is; the upload's manifest is keyed
        by cache key and so sends each object once.
        """
        present: dict[str, bool] = {}
        absent: list[FileRef] = []
        for ref in refs:
            key = _key_of(ref)
            if key not in present:
                with self._lock:
                    present[key] = self._read_facts(key) is not None
            if not present[key]:
                absent.append(ref)
        return absent

    async def ingest(
        self, body: AsyncIterator[bytes], content_type: str, *, max_total_bytes: int
    ) -> list[str]:
        """Store a ``POST /v1/inputs`` multipart body; return the stored keys.

        Every object is checked against the manifest (size and sha256) before any is
        committed, so a rejected upload leaves the cache exactly as it was.
        ``BadRequestError`` names the offending key; ``PayloadTooLargeError`` when the
        body exceeds ``max_total_bytes`` or an object exceeds ``max_object_bytes``.
        """
        staged = await receive_upload(
            body,
            content_type,
            directory=self._root,
            max_object_bytes=self._max_object_bytes,
            max_total_bytes=max_total_bytes,
        )
        # Shielded: a cancellation landing between the parse and the commit would
        # otherwise strand the staging files (_commit removes its own leftovers).
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._commit, staged)
        return [item.key for item in staged]

    async def resolve(self, ref: FileRef) -> CachedObject:
        """The cached object behind ``ref``, pulled from the file server on a miss.

        ``InputMissingError`` naming the ref when it is absent and there is no file
        server, or the pull fails; ``PayloadTooLargeError`` when the pulled object is
        over ``max_object_bytes``. A failed pull caches nothing.
        """
        key = _key_of(ref)
        found = await anyio.to_thread.run_sync(self._lookup, key)
        if found is not None:
            return found
        if self._file_server_url is None:
            raise InputMissingError(f"{describe(ref)} is not in the input cache")
        async with self._pull_guard(key):
            # Concurrent resolves of one object queue here; only the first one fetches.
            found = await anyio.to_thread.run_sync(self._lookup, key)
            if found is None:
                found = await self._pull(ref, key, self._file_server_url)
        return found

    @contextlib.asynccontextmanager
    async def _pull_guard(self, key: str) -> AsyncIterator[None]:
        guard = self._pulls.setdefault(key, _KeyGuard())
        guard.users += 1
        try:
            async with guard.lock:
                yield
        finally:
            guard.users -= 1
            if guard.users == 0:
                del self._pulls[key]

    async def _pull(self, ref: FileRef, key: str, base_url: str) -> CachedObject:
        # The parts passed validate_input_ref (in _key_of): quoting cannot change them,
        # and it stays as a second guard.
        segments = (quote(ref.storage_session, safe=""), quote(ref.object_id, safe=""))
        url = f"{base_url}/files/{segments[0]}/{segments[1]}"
        staging = await anyio.to_thread.run_sync(StagingFile, self._root)
        committing = False
        try:
            digest = await self._fetch_into(staging, ref, url)
            facts = InputObject(size=staging.size, sha256=digest, read_only=ref.read_only)
            committing = True  # from here _commit owns the staging file, renamed or not
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(
                    self._commit, [StagedObject(key=key, temp_path=staging.path, facts=facts)]
                )
        except BaseException:
            if not committing:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(staging.discard)
            raise
        return self._entry(key, facts)

    async def _fetch_into(self, staging: StagingFile, ref: FileRef, url: str) -> str:
        """Stream ``url`` into ``staging``; return the sha256 of what arrived."""
        import httpx

        with map_pull_errors(ref):
            # trust_env=False: proxies and .netrc come from settings, never the environment.
            async with (
                httpx.AsyncClient(
                    timeout=self._http_timeout_s, trust_env=False, follow_redirects=False
                ) as client,
                client.stream(
                    "GET",
                    url,
                    headers={"Accept-Encoding": "identity"},
                    auth=self._file_server_auth,
                ) as response,
            ):
                expected_size = check_response(ref, response, self._max_object_bytes)
                async for chunk in response.aiter_raw():
                    if staging.size + len(chunk) > self._max_object_bytes:
                        raise PayloadTooLargeError(
                            f"{describe(ref)}: over the {self._max_object_bytes} byte cap"
                        )
                    await anyio.to_thread.run_sync(staging.write, chunk)
        digest = await anyio.to_thread.run_sync(staging.finish)
        if expected_size is not None and staging.size != expected_size:
            raise InputMissingError(f"{describe(ref)}: pulled size differs from Content-Length")
        return digest

    def verify(self, key: str) -> bool:
        """Re-hash entry ``key``: True only if it is present and its bytes match (blocking).

        A False for a present entry means its bytes changed after it was stored;
        ``discard`` it so the next probe reports it missing.
        """
        with self._lock:
            facts = self._read_facts(key)
        if facts is None:
            return False
        digest = hashlib.sha256()
        size = 0
        try:
            with self._object_path(key).open("rb") as data:
                while chunk := data.read(_HASH_CHUNK_BYTES):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError:
            return False
        return size == facts.size and digest.hexdigest() == facts.sha256

    def discard(self, key: str) -> None:
        """Remove entry ``key``; quiet if it is already gone (blocking)."""
        with self._lock:
            self._remove(key)
