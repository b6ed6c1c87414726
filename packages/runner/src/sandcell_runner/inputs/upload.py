"""Receive one ``POST /v1/inputs`` body: stream its multipart parts into verified staging files.

Wire shape (``multipart/form-data``), in this order::

    name="manifest"                  InputManifest JSON keyed by input_cache_key
    name=<any>; filename=<cache key> the object's bytes; one part per manifest entry

Nothing here touches a cache entry: ``receive_upload`` hands back staging files whose
size and sha256 match the manifest, and ``InputCache`` commits them. On any failure
every staging file it created is gone before the error reaches the caller.

We drive ``python_multipart.MultipartParser`` ourselves instead of Starlette's
``request.form()``: ``form()`` spools file parts into the system temp directory (maybe
another filesystem, so no atomic rename into the cache), caps non-file parts at its own
limits, and returns only after the whole body is read. Here each part is written straight
into a temp file in the cache directory while it is hashed, the filename is validated
before any file exists, and a size, digest or cap violation aborts at the byte it occurs.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import anyio
from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from sandcell_protocol import InputManifest, InputObject, ProtocolError, decode, is_input_cache_key

from ..errors import BadRequestError, PayloadTooLargeError

TEMP_PREFIX = ".tmp-"
"""Staging files start with a dot so no staging name can ever be mistaken for a cache key."""

MANIFEST_FIELD = "manifest"
MAX_MANIFEST_BYTES = 1024 * 1024
"""The manifest is held in memory until it is decoded, so it gets its own small cap."""


class StagingFile:
    """A new temp file in ``directory`` that hashes and counts what is written to it."""

    def __init__(self, directory: Path) -> None:
        fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
        self.path = Path(name)
        self.size = 0
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()

    def write(self, data: bytes) -> None:
        """Append ``data`` (blocking)."""
        if self._file is None:
            raise RuntimeError("staging file is already closed")
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def finish(self) -> str:
        """Flush to stable storage, close, and return the hex sha256 (blocking)."""
        if self._file is None:
            raise RuntimeError("staging file is already closed")
        self._file.flush()
        # The commit that follows is a rename; without this a crash could leave a
        # committed name pointing at bytes that never reached the disk.
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        return self._hash.hexdigest()

    def discard(self) -> None:
        """Close and remove the file; idempotent (blocking)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class StagedObject:
    """An object whose staging file matches its manifest entry, ready to commit."""

    key: str
    temp_path: Path
    facts: InputObject


class _Upload:
    """Parser callback state for one upload. Every method runs in a worker thread."""

    def __init__(self, directory: Path, *, max_object_bytes: int, max_total_bytes: int) -> None:
        self._directory = directory
        self._max_object_bytes = max_object_bytes
        self._max_total_bytes = max_total_bytes
        self.manifest: InputManifest | None = None
        self.ended = False
        self._staged: dict[str, StagedObject] = {}
        self._headers: dict[str, str] = {}
        self._field = bytearray()
        self._value = bytearray()
        self._manifest_buf: bytearray | None = None
        self._current: StagingFile | None = None
        self._current_key = ""

    def on_part_begin(self) -> None:
        self._headers = {}

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        # Header bytes are latin-1 by HTTP convention; python-multipart assumes the same.
        name = self._field.decode("latin-1").strip().lower()
        if name in self._headers:
            raise BadRequestError(f"multipart part repeats the {name!r} header")
        self._headers[name] = self._value.decode("latin-1").strip()
        self._field.clear()
        self._value.clear()

    def on_headers_finished(self) -> None:
        disposition = self._headers.get("content-disposition")
        if disposition is None:
            raise BadRequestError("multipart part has no Content-Disposition header")
        kind, params = parse_options_header(disposition)
        if kind != b"form-data":
            raise BadRequestError("multipart part is not form-data")
        filename = params.get(b"filename")
        if filename is None:
            self._begin_field(params.get(b"name", b"").decode("latin-1"))
        else:
            self._begin_object(filename.decode("latin-1"))

    def _begin_field(self, name: str) -> None:
        if name != MANIFEST_FIELD:
            raise BadRequestError(f"unexpected form field {name[:64]!r}; only 'manifest' is known")
        if self.manifest is not None:
            raise BadRequestError("the upload has more than one manifest part")
        self._manifest_buf = bytearray()

    def _begin_object(self, key: str) -> None:
        if self.manifest is None:
            raise BadRequestError("the manifest part must come before every object part")
        # Checked before the name is used for anything, so '../x' never reaches a path.
        if not is_input_cache_key(key):
            raise BadRequestError(f"object part filename {key[:80]!r} is not an input cache key")
        if key not in self.manifest.objects:
            raise BadRequestError(f"object {key} is not in the manifest")
        if key in self._staged:
            raise BadRequestError(f"object {key} is uploaded twice")
        self._current = StagingFile(self._directory)
        self._current_key = key

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._manifest_buf is not None:
            if len(self._manifest_buf) + (end - start) > MAX_MANIFEST_BYTES:
                raise PayloadTooLargeError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
            self._manifest_buf += data[start:end]
            return
        current = self._current
        # Every part is a manifest or an object by now: on_headers_finished rejects the rest.
        assert current is not None
        assert self.manifest is not None
        declared = self.manifest.objects[self._current_key].size
        if current.size + (end - start) > declared:
            raise BadRequestError(f"object {self._current_key}: longer than the manifest's size")
        current.write(data[start:end])

    def on_part_end(self) -> None:
        if self._manifest_buf is not None:
            self.manifest = self._decode_manifest(bytes(self._manifest_buf))
            self._manifest_buf = None
            return
        current = self._current
        if current is None:
            return
        key = self._current_key
        assert self.manifest is not None
        facts = self.manifest.objects[key]
        digest = current.finish()
        self._current = None
        # Registered before the checks so discard() removes it if they fail.
        self._staged[key] = StagedObject(key=key, temp_path=current.path, facts=facts)
        if current.size != facts.size:
            raise BadRequestError(
                f"object {key}: size {current.size} does not match the manifest's {facts.size}"
            )
        if digest != facts.sha256:
            raise BadRequestError(f"object {key}: sha256 does not match the manifest")

    def on_end(self) -> None:
        self.ended = True

    def _decode_manifest(self, raw: bytes) -> InputManifest:
        try:
            manifest = decode(raw, InputManifest)
        except ProtocolError as exc:
            raise BadRequestError(f"manifest: {exc}") from exc
        total = 0
        for key, facts in manifest.objects.items():
            if not is_input_cache_key(key):
                raise BadRequestError(f"manifest key {key[:80]!r} is not an input cache key")
            if facts.size > self._max_object_bytes:
                raise PayloadTooLargeError(
                    f"object {key}: {facts.size} bytes is over the {self._max_object_bytes} cap"
                )
            total += facts.size
        if total > self._max_total_bytes:
            raise PayloadTooLargeError(
                f"manifest declares {total} bytes, over the {self._max_total_bytes} upload cap"
            )
        return manifest

    def result(self) -> list[StagedObject]:
        """The staged objects in manifest order, once the body is complete and whole."""
        if not self.ended:
            raise BadRequestError("multipart body is truncated")
        if self.manifest is None:
            raise BadRequestError("the upload has no manifest part")
        absent = [key for key in self.manifest.objects if key not in self._staged]
        if absent:
            raise BadRequestError(f"object {absent[0]} is in the manifest but has no part")
        return [self._staged[key] for key in self.manifest.objects]

    def discard(self) -> None:
        """Remove every staging file this upload created (blocking)."""
        if self._current is not None:
            self._current.discard()
            self._current = None
        for staged in self._staged.values():
            staged.temp_path.unlink(missing_ok=True)
        self._staged.clear()


def _boundary(content_type: str) -> bytes:
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise BadRequestError("content type must be multipart/form-data with a boundary")
    return boundary


def _feed(parser: MultipartParser, chunk: bytes) -> None:
    try:
        parser.write(chunk)
    except FormParserError as exc:
        raise BadRequestError(f"malformed multipart body: {exc}") from exc


async def _parse(
    body: AsyncIterator[bytes], parser: MultipartParser, *, max_total_bytes: int
) -> None:
    received = 0
    async for chunk in body:
        received += len(chunk)
        if received > max_total_bytes:
            raise PayloadTooLargeError(f"upload is over the {max_total_bytes} byte cap")
        if chunk:
            # Parsing and the file writes its callbacks make happen together in one
            # worker-thread hop per chunk, so the event loop never waits on the disk.
            await anyio.to_thread.run_sync(_feed, parser, chunk)


async def receive_upload(
    body: AsyncIterator[bytes],
    content_type: str,
    *,
    directory: Path,
    max_object_bytes: int,
    max_total_bytes: int,
) -> list[StagedObject]:
    """Parse a pushed-input upload into staging files in ``directory``, all verified.

    The caller owns the returned staging files. ``BadRequestError`` for a malformed
    body or a part that disagrees with the manifest, ``PayloadTooLargeError`` for a cap;
    on any error (or cancellation) no staging file is left behind.
    """
    upload = _Upload(directory, max_object_bytes=max_object_bytes, max_total_bytes=max_total_bytes)
    try:
        parser = MultipartParser(
            _boundary(content_type),
            {
                "on_part_begin": upload.on_part_begin,
                "on_header_field": upload.on_header_field,
                "on_header_value": upload.on_header_value,
                "on_header_end": upload.on_header_end,
                "on_headers_finished": upload.on_headers_finished,
                "on_part_data": upload.on_part_data,
                "on_part_end": upload.on_part_end,
                "on_end": upload.on_end,
            },
        )
    except FormParserError as exc:
        raise BadRequestError(f"malformed multipart boundary: {exc}") from exc
    try:
        await _parse(body, parser, max_total_bytes=max_total_bytes)
        return upload.result()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(upload.discard)
        raise
