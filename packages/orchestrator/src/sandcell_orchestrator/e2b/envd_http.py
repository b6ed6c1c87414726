"""envd's plain HTTP routes: ``GET /health``, ``GET /files`` and ``POST /files``.

Files are the session workspace's, read and written through the runner's file
routes (the runner's path checks: no link followed, no escape). Paths are
sandbox paths (``/home/user/…`` or relative to it; ``sandbox_path``). An upload
is ``multipart/form-data`` (one ``file`` field per file, the filename its path
unless a ``path`` is given, which takes one file) or ``application/octet-stream``
(optionally ``Content-Encoding: gzip``), answered by ``[{name, type, path}]``.
A signed URL (``signing.py``) is checked before these run.
"""

from __future__ import annotations

import posixpath
import zlib

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive

from sandcell_protocol import ProtocolError, encode
from sandcell_protocol import sandbox_messages as sm

from ..errors import RunnerRequestError
from ..serve.errors import MAX_BODY_BYTES, form_of, read_body
from ..serve.headers import content_disposition
from .errors import E2bError
from .sandboxes import E2bSandbox

__all__ = ["WrittenEntry", "read_file", "write_files"]

_OCTET_STREAM = "application/octet-stream"


class WrittenEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of an upload's answer."""

    name: str
    type: str
    path: str


def _workspace_path(raw: str | None) -> str:
    if not raw:
        raise E2bError(400, "bad_request", "path: the query parameter is required")
    try:
        path = sm.sandbox_path(raw)
    except ProtocolError as exc:
        raise E2bError(400, "invalid_path", str(exc)) from None
    if not path:
        raise E2bError(400, "invalid_path", f"path: {raw[:200]!r} is a directory")
    return path


def _runner_error(exc: RunnerRequestError, raw: str) -> E2bError:
    if exc.code == "not_found":
        return E2bError(404, "not_found", f"path {raw[:200]!r} not found")
    if exc.code in ("invalid_path", "bad_request"):
        # Its own message names the runner's route; its public detail is about the path.
        return E2bError(
            400, "invalid_path", f"path {raw[:200]!r}: {exc.public_detail or 'refused'}"
        )
    if exc.code == "payload_too_large":
        return E2bError(507, "payload_too_large", f"path {raw[:200]!r}: too large")
    raise exc


async def read_file(request: Request, sandbox: E2bSandbox) -> Response:
    """``GET /files?path=``: the file's bytes."""
    raw = request.query_params.get("path")
    path = _workspace_path(raw)
    if sandbox.handle is None:
        raise E2bError(502, "not_found", f"sandbox {sandbox.sandbox_id} is paused")
    try:
        data = await sandbox.handle.files.read_bytes(path)
    except RunnerRequestError as exc:
        raise _runner_error(exc, raw or "") from None
    headers = {"Content-Disposition": content_disposition("inline", posixpath.basename(path))}
    return Response(data, media_type=_OCTET_STREAM, headers=headers)


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _gunzip(data: bytes) -> bytes:
    # Bounded: a small bomb must not become a huge write.
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, MAX_BODY_BYTES + 1)
    except zlib.error:
        raise E2bError(400, "bad_request", "body: not valid gzip") from None
    if len(out) > MAX_BODY_BYTES or inflater.unconsumed_tail:
        raise E2bError(413, "payload_too_large", f"body: over {MAX_BODY_BYTES} bytes unpacked")
    return out


async def write_files(request: Request, sandbox: E2bSandbox) -> Response:
    """``POST /files``: write one file (octet-stream, or multipart) or several (multipart)."""
    if sandbox.handle is None:
        raise E2bError(502, "not_found", f"sandbox {sandbox.sandbox_id} is paused")
    content_type = request.headers.get("content-type", "")
    uploads: list[tuple[str, bytes]] = []
    # The whole body first, capped: a multipart body is then parsed from memory,
    # never streamed past the cap to disk.
    body = await read_body(request)
    if content_type.startswith("multipart/form-data"):
        buffered = Request(request.scope, receive=_replay(body))
        async with form_of(buffered, max_files=1000, max_part_size=MAX_BODY_BYTES) as form:
            items = form.multi_items()
            one_path = request.query_params.get("path")
            files = [value for key, value in items if key == "file"]
            if not files:
                raise E2bError(400, "bad_request", "multipart: no 'file' field")
            if one_path and len(files) > 1:
                # As envd: a ``path`` names where every part goes, so one part only (and
                # a signed URL's path is the one path it may write).
                raise E2bError(
                    400, "bad_request", "multipart: several files for the one 'path' given"
                )
            for upload in files:
                if not isinstance(upload, UploadFile):
                    raise E2bError(400, "bad_request", "multipart: 'file' must be a file")
                name = one_path or upload.filename
                uploads.append((name or "", await upload.read()))
    else:
        encoding = request.headers.get("content-encoding", "").lower()
        if encoding == "gzip":
            body = _gunzip(body)
        elif encoding not in ("", "identity"):
            raise E2bError(400, "bad_request", f"Content-Encoding {encoding[:40]!r} unsupported")
        uploads.append((request.query_params.get("path") or "", body))
    prepared = [(_workspace_path(raw), raw, data) for raw, data in uploads]
    written: list[WrittenEntry] = []
    for path, raw, data in prepared:
        try:
            await sandbox.handle.files.write(path, data)
        except RunnerRequestError as exc:
            raise _runner_error(exc, raw) from None
        written.append(
            WrittenEntry(
                name=posixpath.basename(path), type="file", path=sm.sandbox_display_path(path)
            )
        )
    return Response(encode(written), media_type="application/json")
