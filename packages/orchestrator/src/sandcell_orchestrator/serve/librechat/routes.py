"""The routes of ``/librechat/v1``: LibreChat's wire translated onto ``ExecutionService``.

    POST   /exec                               run code (stateless, or in a runtime session)
    POST   /upload, /upload/batch              keep files for later runs
    GET    /download/{session_id}/{fileId}     a file's bytes
    GET    /sessions/{session_id}/objects/{fileId}   {lastModified, size, etag}
    GET    /files/{session_id}                 the storage session's files
    DELETE /files/{session_id}/{fileId}        204
    GET    /health                             200, no auth

No lifecycle, lock or storage logic lives here: runs go through the process's
``SandboxManager`` (one ``ExecutionService`` over it), files through its
``InputStore`` (``files.py``), each scoped to the caller's namespace. The file
routes' methods are ``file_routes.FileRoutes``, a base class of ``LibreChatApi``.
"""

from __future__ import annotations

import base64
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sandcell_protocol import (
    ExecuteRequest,
    ExecuteResult,
    FileRef,
    OutputFile,
    ProtocolError,
    RunStatus,
    runtime_session_id,
    validate_hint,
    validate_user_id,
    validate_workspace_path,
)

from ...bootstrap import Services
from ...errors import InputMissingError, SandboxTimeoutError
from ...handle import SandboxHandle
from ...sessions.execution import ExecutionService, Identity
from ..auth import UnauthorizedError
from ..errors import JSON_MEDIA_TYPE, PayloadTooLargeError, read_body
from ..idempotency import (
    Idempotency,
    IdempotencyConflict,
    Replay,
    idempotency_key,
    replayed,
)
from ..stream import run_until_disconnect
from .auth import Caller, LibreChatAuth
from .errors import ExecutionTimeoutError, librechat_json
from .exec_once import ExecOnce
from .file_routes import FileRoutes
from .files import LibreChatFiles, Viewer, visible
from .ids import new_nanoid, require_nanoid
from .limits import TenantLimiter
from .outputs import (
    DELIVERY_FAILED_CODE,
    READ_FAILED_CODE,
    KeptOutputs,
    Refusal,
    deleted_inputs,
)
from .settings import LibreChatSettings
from .wire import (
    ExecAnswer,
    ExecBody,
    InFile,
    ModifiedFrom,
    OutFile,
)

__all__ = ["BODY_KEY_MAX_BYTES", "LANGUAGES", "LibreChatApi"]

log = logging.getLogger(__name__)

LANGUAGES = {
    "py": "python",
    "js": "node",
    "ts": "typescript",
    "bash": "bash",
    "sh": "sh",
    "c": "c",
    "cpp": "cpp",
}
"""LibreChat's ``lang`` -> the runner's language. Others answer 400 ``Unsupported language``;
one the runner lacks answers the same (its ``unsupported_language``)."""
PROFILE_HEADER = "x-codeapi-expected-profile"
BODY_KEY_MAX_BYTES = 1 << 20
"""The most of an exec body read from a caller its headers do not authenticate (a legacy
client's key in the body): a stranger never costs a ``MAX_BODY_BYTES`` read and parse."""
_DEFAULT_USER = "anonymous"


class _BodyKey(msgspec.Struct, frozen=True):
    """The one field of an exec body read before its caller is known."""

    LIBRECHAT_CODE_API_KEY: str | None = None

    def __repr__(self) -> str:
        return "_BodyKey(<hidden>)"


@dataclass(frozen=True, slots=True)
class ResolvedInput:
    """A ``files[]`` ref as resolved: the wire's, and where its bytes are."""

    wire: InFile
    storage: str
    read_only: bool


class LibreChatApi(FileRoutes):
    """State of the API: built once by ``install_librechat``; services resolved lazily."""

    def __init__(
        self,
        settings: LibreChatSettings,
        *,
        auth: LibreChatAuth,
        services: Callable[[], Services],
        new_id: Callable[[], str] = new_nanoid,
    ) -> None:
        self.settings = settings
        self.auth = auth
        self._services = services
        self._new_id = new_id
        self.limiter = TenantLimiter(
            settings.max_concurrent,
            registry=lambda: self._services().registry,
            ttl_s=settings.slot_ttl_s,
        )
        self.idempotency = Idempotency(lambda: self._services().registry)
        self._execution: ExecutionService | None = None
        self._files: LibreChatFiles | None = None

    @property
    def execution(self) -> ExecutionService:
        # The process's one manager: this API only chooses stateless vs. session per
        # call (a call without a hint is stateless whatever SANDCELL_RUNTIME_SESSION_MODE).
        if self._execution is None:
            services = self._services()
            self._execution = ExecutionService(
                manager=services.manager,
                mode="affinity",
                inputs=services.inputs,
                spec=services.execution.spec,
                keep_warm=services.execution.keep_warm,
                checkpoint_retry_s=services.execution.checkpoint_retry_s,
            )
        return self._execution

    def new_id(self) -> str:
        """A fresh nanoid (the injected generator)."""
        return self._new_id()

    @property
    def files(self) -> LibreChatFiles:
        if self._files is None:
            self._files = LibreChatFiles(self._services().inputs)
        return self._files

    # -- exec ---------------------------------------------------------------------

    async def exec(self, request: Request) -> Response:
        caller, raw = await self._exec_caller(request)
        try:
            body = msgspec.json.decode(raw, type=ExecBody, strict=True)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"exec body: {exc}") from None
        language = LANGUAGES.get(body.lang)
        if language is None:
            return librechat_json(400, {"error": "bad_request", "message": "Unsupported language"})
        user = self.user_of(caller, request, body.user_id)
        owner = self.owner_of(caller, request, body.user_id)
        hint = body.runtime_session_hint
        if request.headers.get(PROFILE_HEADER, "").lower() == "default":
            hint = None
        if hint is not None:
            validate_hint(hint)
            runtime_session_id(caller.namespace, user, hint)  # a bad user is a 400 up front
        inputs = await self.resolve_inputs(caller, body.files)
        timeout_s = self.timeout_s(body.timeout)
        run = ExecuteRequest(
            language=language,
            code=body.code,
            args=list(body.args or []),
            timeout_ms=max(1, round(timeout_s * 1000)),
            files=self.refs_of(inputs),
        )

        identity = Identity(namespace=caller.namespace, user_id=user)
        kept = self.kept_outputs(inputs)
        # The storage session of the run's kept outputs (the answer's session_id), and
        # those outputs (files, artifact_delivery) once stored.
        session_id = self._new_id()
        outputs: list[tuple[list[OutFile], dict[str, object] | None]] = []
        deleted: list[str] = []

        async def collect(handle: SandboxHandle, files: list[OutputFile]) -> None:
            # Stored while the turn holds its sandbox, before the turn commits: a keyed
            # turn's commit stores the answer, and the answer names these files.
            await kept.collect(handle, files)
            outputs[:] = [await self.keep_outputs(caller, owner, session_id, files, inputs, kept)]
            if inputs:
                names = [item.wire.name for item in inputs]
                deleted[:] = await deleted_inputs(handle, names, files)

        def built(result: ExecuteResult) -> bytes | None:
            """The answer to ``result`` (None: a timeout, answered 504 and never kept)."""
            if result.status == RunStatus.TIMEOUT:
                return None
            files, delivery = outputs[0] if outputs else ([], None)
            answer = self._answer(result, session_id, files, delivery)
            if deleted:
                answer = msgspec.structs.replace(answer, deleted_files=list(deleted))
            if hint is not None:
                answer = msgspec.structs.replace(
                    answer,
                    runtime_session_id=runtime_session_id(caller.namespace, user, hint),
                    runtime_status="reused" if existed else "new",
                )
            return msgspec.json.encode(answer)

        # Whether the call's runtime session had a record before it (``runtime_status``).
        existed = False

        # A keyed session turn saves these answer bytes in the store: a retry the
        # registry forgot (a wiped Redis) answers them, file ids and all.
        once = ExecOnce(built)

        def stored(result: ExecuteResult) -> tuple[int, bytes] | None:
            answer = once.answer(result)
            return None if answer is None else (200, answer)

        # Every JWT caller shares one namespace: its (verified) user is part of the
        # scope, so one user's key never replays another user's answer.
        scope = caller.namespace
        if caller.token_user is not None:
            scope = f"{caller.namespace}\0{caller.token_user}"
        claim = await self.idempotency.claim(
            surface="librechat/exec",
            namespace=scope,
            key=idempotency_key(request),
            body=raw,
            # Its answer's bytes (file ids and all) are kept in the store too.
            stateless=self.execution.runs_stateless(hint),
        )
        if isinstance(claim, IdempotencyConflict):
            return claim.response()
        if isinstance(claim, Replay):
            return replayed(
                Response(claim.body, status_code=claim.status, media_type=JSON_MEDIA_TYPE)
            )

        async def answered() -> bytes:
            nonlocal existed
            async with self.limiter.slot(caller.namespace):
                if hint is not None:
                    # Looked up before the turn (which makes the record): a session
                    # with one has its /mnt/data (warm, or from its checkpoint).
                    record = await self._services().manager.record(
                        runtime_session_id(caller.namespace, user, hint)
                    )
                    existed = record is not None
                try:
                    # A keyed session turn: its answer goes with the fenced record write
                    # that commits it (exactly once, as /v1/exec's), and into the store.
                    result = await self.execution.execute(
                        run,
                        identity,
                        hint=hint,
                        collect=collect,
                        answer=claim.answering(stored),
                        turn_key=claim.key,
                        saved=once.codec,
                    )
                except SandboxTimeoutError as exc:
                    # Its message names the runner's route: the log's, not the caller's.
                    log.warning("exec: the sandbox did not answer in time: %s", exc)
                    raise ExecutionTimeoutError("the sandbox did not answer in time") from None
            answer = once.answer(result)
            if answer is None:
                raise ExecutionTimeoutError(f"the run passed its {timeout_s:g} s limit")
            return answer

        # An error is not kept: the claim is dropped and a retry runs again. Outputs
        # ``collect`` stored for a run that then failed (a timeout, a commit that
        # could not be written, a client that left) are removed: no answer names them.
        run_kept = claim.kept(
            answered(),
            stored=lambda answer: (200, answer),
            unanswered=lambda: self._drop_outputs(caller, session_id, outputs),
        )
        # A caller that leaves takes its run with it (the job is stopped, a session
        # keeps what it wrote until then), as on /v1/exec: nobody reads the answer.
        # A keyed run goes on to its end, for the retry its client said would come.
        kept_body = await run_until_disconnect(request, run_kept, detached=claim.key is not None)
        if kept_body is None:
            return Response(status_code=499)
        return Response(kept_body, media_type=JSON_MEDIA_TYPE)

    async def _drop_outputs(
        self,
        caller: Caller,
        session_id: str,
        outputs: list[tuple[list[OutFile], dict[str, object] | None]],
    ) -> None:
        """Remove a run's kept outputs that no answer names (a run that failed)."""
        for files, _ in outputs:
            await self._delete_kept(caller, session_id, files)

    async def _delete_kept(self, caller: Caller, session_id: str, files: list[OutFile]) -> None:
        for file in files:
            if not file.inherited:
                await self.files.delete(caller.namespace, session_id, file.id)

    async def _exec_caller(self, request: Request) -> tuple[Caller, bytes]:
        """The caller and the body: by the headers, else by a legacy body key.

        A call its headers do not authenticate is a stranger until its key is found:
        it gets at most ``BODY_KEY_MAX_BYTES`` read and only the key decoded, and
        every failure (too long, not JSON, no key, a wrong one) is the same 401.
        """
        caller = self.auth.header_caller(request)
        if caller is not None:
            return caller, await read_body(request)
        try:
            raw = await read_body(request, max_bytes=BODY_KEY_MAX_BYTES)
            key = msgspec.json.decode(raw, type=_BodyKey).LIBRECHAT_CODE_API_KEY
        except (PayloadTooLargeError, msgspec.MsgspecError):
            raise UnauthorizedError from None
        return self.auth.body_key_caller(key), raw

    def user_of(self, caller: Caller, request: Request, named: str | None) -> str:
        """The run's user: the token's, else the one the call names, else a default.

        Checked whether or not the call names a runtime session: the user is kept
        with the run's output files either way."""
        return self.owner_of(caller, request, named) or _DEFAULT_USER

    @staticmethod
    def owner_of(caller: Caller, request: Request, named: str | None) -> str | None:
        """Who owns the run's outputs: the token's user, else the one the call names, else
        nobody (``None``: the namespace's, ``files.visible``). The client names no user
        on a programmatic call, so LibreChat's download for its user must still find
        what an API-key run produced."""
        user = caller.token_user or named or request.headers.get("user-id") or None
        return None if user is None else validate_user_id(user)

    def timeout_s(self, timeout_ms: int | None) -> float:
        """The call's ``timeout`` (ms) capped, or the default."""
        if timeout_ms:
            return min(timeout_ms / 1000, self.settings.max_timeout_s)
        return self.settings.default_timeout_s

    async def resolve_inputs(
        self, caller: Caller, items: list[InFile] | None
    ) -> list[ResolvedInput]:
        return [await self._resolve_input(caller, item) for item in items or []]

    @staticmethod
    def refs_of(inputs: list[ResolvedInput]) -> list[FileRef]:
        return [
            FileRef(
                storage_session=item.storage,
                object_id=item.wire.id,
                name=item.wire.name,
                read_only=item.read_only,
            )
            for item in inputs
        ]

    async def _resolve_input(self, caller: Caller, item: InFile) -> ResolvedInput:
        storage = item.storage
        if storage is None:
            raise ProtocolError("files[]: a ref needs storage_session_id (or session_id)")
        require_nanoid("files[].storage_session_id", storage)
        require_nanoid("files[].id", item.id)
        try:
            # Checked here, before a sandbox is held for the call, by the protocol's
            # one rule for workspace paths (the runner applies it again).
            validate_workspace_path(item.name)
        except ProtocolError as exc:
            raise ProtocolError(f"files[].name {item.name[:100]!r}: {exc}") from exc
        meta = await self.files.meta(caller.namespace, storage, item.id)
        viewer = Viewer(
            user_id=caller.token_user, kind=item.kind, resource_id=item.resource_id, vouched=True
        )
        if meta is None or (caller.token_user is not None and not visible(meta, viewer)):
            # Absent, another tenant's, or (for a token's user, whom the token vouches
            # for) one that user may not download: the same words either way.
            missing = f"input {item.id} (for {item.name}) not found"
            raise InputMissingError(missing, public_detail=missing)
        return ResolvedInput(wire=item, storage=storage, read_only=meta.read_only)

    @staticmethod
    def _answer(
        result: ExecuteResult,
        session_id: str,
        files: list[OutFile],
        delivery: dict[str, object] | None,
    ) -> ExecAnswer:
        """The exec answer: ``result`` with its outputs kept under ``session_id``."""
        return ExecAnswer(
            session_id=session_id,
            stdout=result.stdout,
            stderr=result.stderr,
            files=files,
            code=result.exit_code,
            signal=result.signal,
            status=str(result.status),
            wall_time=result.wall_ms / 1000,
            artifact_delivery=delivery,
        )

    def kept_outputs(self, inputs: list[ResolvedInput]) -> KeptOutputs:
        """A run's collector of outputs (``outputs.KeptOutputs``), within the byte cap."""
        return KeptOutputs(
            max_bytes=self.settings.max_output_bytes,
            skip=frozenset(item.wire.name for item in inputs if item.read_only),
            metrics=self._services().manager.metrics,
        )

    async def keep_outputs(
        self,
        caller: Caller,
        user: str | None,
        session_id: str,
        outputs: list[OutputFile],
        inputs: list[ResolvedInput],
        kept: KeptOutputs,
    ) -> tuple[list[OutFile], dict[str, object] | None]:
        """Store ``outputs`` under ``session_id``: the answer's ``files`` and, when some
        could not be kept (over the run's byte cap, or unreadable), its
        ``artifact_delivery``. ``kept`` holds what was read from the sandbox."""
        by_name = {item.wire.name: item for item in inputs}
        files: list[OutFile] = []
        attempted = 0
        errors: list[dict[str, str]] = []
        for output in outputs:
            if output.symlink_target is not None:
                continue
            source = by_name.get(output.name)
            if source is not None and source.read_only:
                # Read-only inputs are the caller's own: echoed, never replaced.
                files.append(
                    OutFile(
                        id=source.wire.id,
                        name=source.wire.name,
                        storage_session_id=source.storage,
                        inherited=True,
                    )
                )
                continue
            attempted += 1
            data = self._bytes_of(output, kept)
            if data is None:
                refusal = kept.refusal(output) or Refusal(READ_FAILED_CODE, "it was not read")
                errors.append(
                    {"name": output.name, "code": refusal.code, "message": refusal.message}
                )
                continue
            file_id = self._new_id()
            files.append(
                OutFile(
                    id=file_id,
                    name=output.name,
                    storage_session_id=session_id,
                    path=f"/mnt/data/{output.name}",
                    modified_from=(
                        ModifiedFrom(id=source.wire.id, storage_session_id=source.storage)
                        if source is not None
                        else None
                    ),
                )
            )
            try:
                await self.files.put(
                    caller.namespace, session_id, file_id, data, filename=output.name, user_id=user
                )
            except BaseException:
                # Part way (a store that failed, a run cancelled): what this call stored,
                # the failed put's bytes included, is named by no answer.
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await self._delete_kept(caller, session_id, files)
                raise
        delivery: dict[str, object] | None = None
        if errors:
            # The summary's code is the one the client reads (any other makes it drop the
            # whole summary, and the model is never warned); each error keeps its reason.
            delivery = {
                "code": DELIVERY_FAILED_CODE,
                "status": "failed" if len(errors) == attempted else "partial",
                "attempted": attempted,
                "delivered": attempted - len(errors),
                "failed": len(errors),
                "errors": errors,
            }
        return files, delivery

    @staticmethod
    def _bytes_of(output: OutputFile, kept: KeptOutputs) -> bytes | None:
        """The output's bytes as kept: inline, read from the sandbox, or None (refused)."""
        if kept.refusal(output) is not None:
            return None
        if output.content_b64 is not None:
            return base64.b64decode(output.content_b64)
        if output.size == 0:
            return b""
        return kept.bytes_of(output)

    async def health(self, _request: Request) -> Response:
        return librechat_json(200, {"status": "ok"})
