"""``RunnerClient``: the only code that speaks HTTP to a runner.

One pooled ``httpx.AsyncClient`` per sandbox. The transport is injectable, so
the same client talks to a runner on loopback, an in-process ASGI app, or a
cloud proxy (with an ``httpx.Auth`` adding the proxy's header). Every method
maps 1:1 onto one runner route; the higher layers (``SandboxHandle``,
``SandboxManager``, ``ExecutionService``) are built on it.

Secrets: the bearer token and any header an injected auth adds never reach an
exception message, a ``repr`` or a log line; transport errors are re-raised
``from None`` and every message passes through a ``Redactor``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
import uuid
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Literal, TypeVar
from urllib.parse import quote

import anyio
import anyio.to_thread
import httpx
import msgspec

from sandcell_protocol import (
    PROTOCOL_VERSION,
    ExecuteRequest,
    ExecuteResult,
    FileEntry,
    FileListing,
    FileRef,
    Health,
    InputManifest,
    InputObject,
    InputProbe,
    InputProbeResult,
    InputUploadResult,
    ProtocolError,
    RestoreResult,
    ResultEvent,
    StreamEvent,
    check_compatible,
    decode,
    decode_event,
    encode,
    headers,
    input_cache_key,
    is_runtime_session_id,
    routes,
    validate_workspace_path,
)
from sandcell_protocol import ProtocolMismatchError as WireMismatch

from .errors import (
    ConfigError,
    ProtocolMismatchError,
    RunnerRequestError,
    SandboxTimeoutError,
    SandboxUnavailableError,
)
from .runner_errors import (
    HeaderGuard,
    Redactor,
    error_from_response,
    map_transport_errors,
)

__all__ = ["CheckpointEncoding", "CheckpointStream", "InputPayload", "RunnerClient"]

log = logging.getLogger(__name__)

T = TypeVar("T")
CheckpointEncoding = Literal["zstd", "gzip"]

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
EXECUTE_MARGIN_S = 10.0
"""Read-timeout slack past a job's own deadline: the runner still reaps and collects."""
_HASH_INLINE_MAX_BYTES = 1 << 20
"""Hash bigger pushes in a worker thread so the event loop keeps serving."""
_B64TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


@dataclass(frozen=True, slots=True)
class InputPayload:
    """One input object to push into a runner's input cache."""

    storage_session: str
    object_id: str
    data: bytes
    read_only: bool = False

    def __repr__(self) -> str:
        # The bytes are user data: keep them out of reprs and logs.
        return (
            f"InputPayload(storage_session={self.storage_session!r}, "
            f"object_id={self.object_id!r}, size={len(self.data)}, read_only={self.read_only})"
        )


class _ProtocolOnly(msgspec.Struct):
    """The one ``Health`` field every protocol major must keep, read leniently."""

    protocol: str


class CheckpointStream:
    """The compressed checkpoint bytes as the runner sent them, hashed on the way through.

    ``sha256`` and ``size_bytes`` describe what has been read so far; ``complete``
    turns true once the runner's stream ended cleanly.
    """

    def __init__(
        self,
        response: httpx.Response,
        *,
        encoding: CheckpointEncoding,
        mapper: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self.encoding: CheckpointEncoding = encoding
        self.size_bytes = 0
        self.complete = False
        self._chunks = response.aiter_raw()
        self._hash = hashlib.sha256()
        self._mapper = mapper

    def __repr__(self) -> str:
        return f"CheckpointStream(encoding={self.encoding!r}, size_bytes={self.size_bytes})"

    @property
    def sha256(self) -> str:
        """Hex sha256 of the bytes read so far (of the whole checkpoint once ``complete``)."""
        return self._hash.hexdigest()

    def __aiter__(self) -> CheckpointStream:
        return self

    async def __anext__(self) -> bytes:
        with self._mapper():
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                self.complete = True
                raise
        self._hash.update(chunk)
        self.size_bytes += len(chunk)
        return chunk


def _new_request_id() -> str:
    return uuid.uuid4().hex


def _invalid(code: str, message: str) -> RunnerRequestError:
    """A request refused before it left: the same error the runner would have given."""
    return RunnerRequestError(f"refused before sending: {message}", code=code)


def _file_route(path: str, *, allow_root: bool = False) -> str:
    if allow_root and path in ("", ".", "/"):
        return routes.SESSION_FILES_PREFIX
    try:
        normalized = validate_workspace_path(path)
    except ProtocolError as exc:
        raise _invalid("invalid_path", str(exc)) from None
    return routes.SESSION_FILES_PREFIX + "/".join(
        quote(part, safe="") for part in normalized.split("/")
    )


class RunnerClient:
    """An HTTP client of one runner. Use as ``async with`` or call ``close()``."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        transport: httpx.AsyncBaseTransport | None = None,
        auth: httpx.Auth | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        new_request_id: Callable[[], str] = _new_request_id,
    ) -> None:
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"runner base_url: expected http(s)://host[:port], got {url.scheme}")
        if not _B64TOKEN_RE.fullmatch(token):
            # Never echo the value: a wrong one is still somebody's secret.
            raise ConfigError("runner token: not a valid bearer token (RFC 6750 b64token)")
        self.base_url = str(url.copy_with(username=None, password=None, query=None))
        self._token = token
        self._timeout_s = timeout_s
        self._clock = clock
        self._new_request_id = new_request_id
        self._redact = Redactor([token, headers.BEARER_PREFIX + token])
        self._compatible = False
        self._contact_lock = anyio.Lock()
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            auth=HeaderGuard(auth),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers={headers.PROTOCOL: PROTOCOL_VERSION},
            follow_redirects=False,
            # No proxy variables or .netrc: a token must go only where the caller sent it.
            trust_env=False,
        )

    def __repr__(self) -> str:
        return f"RunnerClient(base_url={self.base_url!r})"

    async def __aenter__(self) -> RunnerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool; idempotent."""
        await self._client.aclose()

    # -- plumbing -------------------------------------------------------------

    async def _request(
        self,
        method: str,
        route: str,
        *,
        session_id: str | None = None,
        message: object = None,
        extra_headers: Mapping[str, str] | None = None,
        read_timeout_s: float | None = None,
        stream: bool = False,
        **kwargs: object,
    ) -> httpx.Response:
        """Build (validating first), check the protocol on first contact, send."""
        request_headers = {headers.REQUEST_ID: self._new_request_id(), **(extra_headers or {})}
        request_headers[headers.AUTHORIZATION] = headers.BEARER_PREFIX + self._token
        if session_id is not None:
            if not is_runtime_session_id(session_id):
                raise _invalid("bad_request", "session_id must match ^rt_[0-9a-f]{64}$")
            request_headers[headers.RUNTIME_SESSION_ID] = session_id
        if message is not None:
            kwargs["content"] = encode(message)
            request_headers.setdefault("Content-Type", JSON)
        if read_timeout_s is not None:
            default = self._client.timeout
            kwargs["timeout"] = httpx.Timeout(
                default.read, connect=default.connect, read=read_timeout_s
            )
        request = self._client.build_request(
            method,
            route,
            headers=request_headers,
            **kwargs,  # type: ignore[arg-type]
        )
        await self._ensure_compatible()
        return await self._send(request, stream=stream)

    def _mapping(self, request: httpx.Request) -> contextlib.AbstractContextManager[None]:
        return map_transport_errors(request, route=request.url.path, redact=self._redact)

    async def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send, translating transport failures and non-2xx answers; logs no header."""
        started = self._clock()
        with self._mapping(request):
            response = await self._client.send(request, stream=stream)
        self._redact.learn(response.request.headers)
        log.debug(
            "runner %s %s -> %d in %.1f ms (request %s)",
            request.method,
            request.url.path,
            response.status_code,
            (self._clock() - started) * 1000,
            request.headers.get(headers.REQUEST_ID),
        )
        if response.is_success:
            return response
        try:
            with self._mapping(request):
                body = await response.aread()
        finally:
            await response.aclose()
        raise error_from_response(
            method=request.method,
            route=request.url.path,
            status=response.status_code,
            body=body,
            redact=self._redact,
        )

    def _decode(self, response: httpx.Response, type_: type[T]) -> T:
        try:
            return decode(response.content, type_)
        except ProtocolError as exc:
            where = f"{response.request.method} {response.request.url.path}"
            raise SandboxUnavailableError(f"{where}: malformed answer: {exc}") from None

    async def _ensure_compatible(self) -> None:
        if self._compatible:
            return
        async with self._contact_lock:
            if not self._compatible:
                await self._fetch_health(timeout_s=None)

    async def _fetch_health(self, *, timeout_s: float | None) -> Health:
        request = self._client.build_request(
            "GET", routes.HEALTH, headers={headers.REQUEST_ID: self._new_request_id()}
        )
        if timeout_s is not None:
            # Connect included: a poll must not outlive the caller's deadline.
            request.extensions["timeout"] = httpx.Timeout(timeout_s).as_dict()
        response = await self._send(request)
        # Check the version before the full shape: another major may have other fields.
        try:
            peer = msgspec.json.decode(response.content, type=_ProtocolOnly).protocol
        except msgspec.MsgspecError:
            raise SandboxUnavailableError(f"GET {routes.HEALTH}: malformed answer") from None
        try:
            check_compatible(peer)
        except WireMismatch:
            raise ProtocolMismatchError(
                f"runner at {self.base_url} speaks protocol {peer[:32]!r}; this orchestrator"
                f" speaks {PROTOCOL_VERSION!r} (protocol majors must match)"
            ) from None
        health = self._decode(response, Health)
        self._compatible = True
        return health

    # -- health ---------------------------------------------------------------

    async def health(self) -> Health:
        """``GET /health`` (unauthenticated); checks the protocol major every time."""
        return await self._fetch_health(timeout_s=None)

    async def wait_ready(self, *, timeout_s: float, interval_s: float = 0.05) -> Health:
        """Poll ``/health`` until the runner says ``ok``.

        ``SandboxUnavailableError`` at the deadline. A quarantined runner never
        recovers and a protocol mismatch never heals: both raise at once.
        """
        deadline = self._clock() + timeout_s
        last = "no answer"
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise SandboxUnavailableError(
                    f"runner at {self.base_url} not ready in {timeout_s:.1f}s: {last}"
                )
            try:
                health = await self._fetch_health(timeout_s=max(min(remaining, 2.0), 0.01))
            except (SandboxUnavailableError, SandboxTimeoutError) as exc:
                last = str(exc)
            else:
                if health.status == "ok":
                    return health
                if health.status == "quarantined":
                    raise SandboxUnavailableError(f"runner at {self.base_url} is quarantined")
                last = f"status {health.status}"
            await anyio.sleep(min(interval_s, max(deadline - self._clock(), 0)))

    # -- execute --------------------------------------------------------------

    def _execute_read_s(self, request: ExecuteRequest, timeout_s: float | None) -> float:
        if timeout_s is not None:
            return timeout_s
        return max(self._timeout_s, request.timeout_ms / 1000 + EXECUTE_MARGIN_S)

    async def execute(
        self,
        request: ExecuteRequest,
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
    ) -> ExecuteResult:
        """``POST /v1/execute``; the read timeout defaults past the job's own deadline."""
        read_s = self._execute_read_s(request, timeout_s)
        response = await self._request(
            "POST", routes.EXECUTE, session_id=session_id, message=request, read_timeout_s=read_s
        )
        return self._decode(response, ExecuteResult)

    async def execute_stream(
        self,
        request: ExecuteRequest,
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """``POST /v1/execute`` as NDJSON: output chunks as produced, then one ``ResultEvent``.

        Close the iterator (``contextlib.aclosing``) when leaving early.
        """
        response = await self._request(
            "POST",
            routes.EXECUTE,
            session_id=session_id,
            message=request,
            extra_headers={"Accept": routes.NDJSON},
            read_timeout_s=self._execute_read_s(request, timeout_s),
            stream=True,
        )
        try:
            with self._mapping(response.request):
                if not response.headers.get("content-type", "").startswith(routes.NDJSON):
                    # A peer that ignored Accept answered one ExecuteResult.
                    await response.aread()
                    yield ResultEvent(result=self._decode(response, ExecuteResult))
                    return
                seen_result = False
                async for line in response.aiter_lines():
                    if line.strip():
                        event = _decode_event(line)
                        seen_result = isinstance(event, ResultEvent)
                        yield event
            if not seen_result:
                raise SandboxUnavailableError(f"POST {routes.EXECUTE}: stream ended before result")
        finally:
            await response.aclose()

    # -- checkpoint / restore / release ----------------------------------------

    @contextlib.asynccontextmanager
    async def checkpoint(
        self,
        *,
        session_id: str,
        encoding: CheckpointEncoding = "zstd",
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
    ) -> AsyncIterator[CheckpointStream]:
        """``GET /v1/session/checkpoint``: yields the compressed archive as sent.

        ``encoding`` is a preference; the yielded stream's ``encoding`` says which arrived.
        ``include`` / ``exclude`` are workspace globs (a ``PersistentWorkspace``).
        """
        params = [("include", p) for p in include] + [("exclude", p) for p in exclude]
        response = await self._request(
            "GET",
            routes.SESSION_CHECKPOINT,
            session_id=session_id,
            extra_headers={"Accept-Encoding": encoding},
            stream=True,
            params=params or None,
        )
        try:
            arrived = _checkpoint_encoding(response)
            yield CheckpointStream(
                response, encoding=arrived, mapper=lambda: self._mapping(response.request)
            )
        finally:
            await response.aclose()

    async def restore(
        self,
        chunks: AsyncIterable[bytes],
        *,
        session_id: str,
        sha256: str | None = None,
        timeout_s: float | None = None,
    ) -> RestoreResult:
        """``POST /v1/session/restore``, streaming ``chunks`` (the runner sniffs gzip/zstd).

        With ``sha256`` the runner rejects a body whose digest differs.
        """
        extra = {"Content-Type": OCTET_STREAM}
        if sha256 is not None:
            extra[headers.CHECKPOINT_SHA256] = sha256
        response = await self._request(
            "POST",
            routes.SESSION_RESTORE,
            session_id=session_id,
            content=chunks,
            extra_headers=extra,
            read_timeout_s=timeout_s,
        )
        return self._decode(response, RestoreResult)

    async def release_session(self, *, session_id: str) -> None:
        """``DELETE /v1/session``: wipe the session workspace and unbind the runner."""
        await self._request("DELETE", routes.SESSION, session_id=session_id)

    # -- inputs ---------------------------------------------------------------

    async def probe_inputs(
        self, refs: Sequence[FileRef], *, session_id: str | None = None
    ) -> list[FileRef]:
        """``POST /v1/inputs/probe``: the refs whose objects the runner's cache lacks."""
        probe = InputProbe(refs=list(refs))
        response = await self._request(
            "POST", routes.INPUTS_PROBE, session_id=session_id, message=probe
        )
        return self._decode(response, InputProbeResult).missing

    async def push_inputs(
        self, objects: Sequence[InputPayload], *, session_id: str | None = None
    ) -> list[str]:
        """``POST /v1/inputs`` (multipart: manifest first, one part per object); stored keys."""
        unique: dict[str, InputPayload] = {}
        for item in objects:
            try:
                unique.setdefault(input_cache_key(item.storage_session, item.object_id), item)
            except ProtocolError as exc:
                raise _invalid("bad_request", str(exc)) from None
        if not unique:
            return []
        if sum(len(item.data) for item in unique.values()) > _HASH_INLINE_MAX_BYTES:
            manifest = await anyio.to_thread.run_sync(_manifest, unique)
        else:
            manifest = _manifest(unique)
        response = await self._request(
            "POST",
            routes.INPUTS,
            session_id=session_id,
            # httpx writes data fields before file parts: the manifest goes first.
            data={"manifest": encode(manifest).decode()},
            files=[("object", (key, item.data, OCTET_STREAM)) for key, item in unique.items()],
        )
        return self._decode(response, InputUploadResult).stored

    # -- session files ----------------------------------------------------------

    async def read_file(self, path: str, *, session_id: str) -> bytes:
        """``GET /v1/session/files/{path}``: a regular file's bytes."""
        response = await self._request("GET", _file_route(path), session_id=session_id)
        if _is_json(response):
            raise RunnerRequestError(f"GET {path}: is a directory", code="invalid_path")
        return response.content

    async def list_files(self, path: str = "", *, session_id: str) -> FileListing:
        """``GET /v1/session/files/{dir}``: the direct entries of a directory ("" = root)."""
        route = _file_route(path, allow_root=True)
        response = await self._request("GET", route, session_id=session_id)
        if not _is_json(response):
            raise RunnerRequestError(f"GET {path}: not a directory", code="invalid_path")
        return self._decode(response, FileListing)

    async def write_file(
        self, path: str, data: bytes, *, session_id: str, mode: int | None = None
    ) -> FileEntry:
        """``PUT /v1/session/files/{path}`` with the raw bytes; ``mode``: permission bits."""
        params: dict[str, str] = {}
        if mode is not None:
            if not 0 <= mode <= 0o777:
                raise _invalid("bad_request", f"mode {mode:#o}: only permission bits 0..0o777")
            params["mode"] = f"{mode:04o}"
        response = await self._request(
            "PUT",
            _file_route(path),
            session_id=session_id,
            content=data,
            params=params,
            extra_headers={"Content-Type": OCTET_STREAM},
        )
        return self._decode(response, FileEntry)

    async def delete_file(self, path: str, *, session_id: str) -> None:
        """``DELETE /v1/session/files/{path}``; ``not_found`` if absent."""
        await self._request("DELETE", _file_route(path), session_id=session_id)


def _is_json(response: httpx.Response) -> bool:
    return str(response.headers.get("content-type", "")).startswith(JSON)


def _decode_event(line: str) -> StreamEvent:
    try:
        return decode_event(line)
    except ProtocolError as exc:
        raise SandboxUnavailableError(f"POST {routes.EXECUTE}: malformed event: {exc}") from None


def _checkpoint_encoding(response: httpx.Response) -> CheckpointEncoding:
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    content_encoding = response.headers.get("content-encoding", "").strip().lower()
    if media == routes.ZSTD or content_encoding == "zstd":
        return "zstd"
    if media == routes.GZIP or content_encoding == "gzip":
        return "gzip"
    raise SandboxUnavailableError(
        f"GET {routes.SESSION_CHECKPOINT}: not a checkpoint (content type {media[:64]!r})"
    )


def _manifest(objects: Mapping[str, InputPayload]) -> InputManifest:
    return InputManifest(
        objects={
            key: InputObject(
                size=len(item.data),
                sha256=hashlib.sha256(item.data).hexdigest(),
                read_only=item.read_only,
            )
            for key, item in objects.items()
        }
    )
