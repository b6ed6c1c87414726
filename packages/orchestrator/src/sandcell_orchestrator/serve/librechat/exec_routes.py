"""``POST /librechat/v1/exec``: one run, stateless or in a runtime session.

The call's caller (by its headers, else a legacy client's key in the body), its
``files[]`` resolved (``inputs.py``), the run through the process's
``ExecutionService``, its outputs kept under a fresh storage session
(``delivery.py``), and the answer, kept once per idempotency key. No lifecycle,
lock or storage logic lives here.
"""

from __future__ import annotations

import logging

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sandcell_protocol import (
    ExecuteRequest,
    ExecuteResult,
    OutputFile,
    ProtocolError,
    RunStatus,
    runtime_session_id,
    validate_hint,
)

from ...errors import SandboxTimeoutError
from ...handle import SandboxHandle
from ...sessions.execution import Identity
from ..auth import UnauthorizedError
from ..errors import JSON_MEDIA_TYPE, PayloadTooLargeError, read_body
from ..idempotency import IdempotencyConflict, Replay, idempotency_key, replayed
from ..stream import run_until_disconnect
from .api import LibreChatApi
from .auth import Caller
from .delivery import Delivered, drop_outputs, keep_outputs, kept_outputs
from .errors import ExecutionTimeoutError, librechat_json
from .exec_once import ExecOnce
from .inputs import refs_of, resolve_inputs
from .outputs import deleted_inputs
from .wire import ExecAnswer, ExecBody, OutFile

__all__ = ["BODY_KEY_MAX_BYTES", "LANGUAGES", "ExecRoutes"]

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


class _BodyKey(msgspec.Struct, frozen=True):
    """The one field of an exec body read before its caller is known."""

    LIBRECHAT_CODE_API_KEY: str | None = None

    def __repr__(self) -> str:
        return "_BodyKey(<hidden>)"


class ExecRoutes:
    """``/exec`` on the API's shared state."""

    def __init__(self, api: LibreChatApi) -> None:
        self._api = api

    async def exec(self, request: Request) -> Response:
        api = self._api
        caller, raw = await self._exec_caller(request)
        try:
            body = msgspec.json.decode(raw, type=ExecBody, strict=True)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"exec body: {exc}") from None
        language = LANGUAGES.get(body.lang)
        if language is None:
            return librechat_json(400, {"error": "bad_request", "message": "Unsupported language"})
        user = api.user_of(caller, request, body.user_id)
        owner = api.owner_of(caller, request, body.user_id)
        hint = body.runtime_session_hint
        if request.headers.get(PROFILE_HEADER, "").lower() == "default":
            hint = None
        if hint is not None:
            validate_hint(hint)
            runtime_session_id(caller.namespace, user, hint)  # a bad user is a 400 up front
        inputs = await resolve_inputs(api.files, caller, body.files)
        timeout_s = api.timeout_s(body.timeout)
        run = ExecuteRequest(
            language=language,
            code=body.code,
            args=list(body.args or []),
            timeout_ms=max(1, round(timeout_s * 1000)),
            files=refs_of(inputs),
        )

        identity = Identity(namespace=caller.namespace, user_id=user)
        kept = kept_outputs(api, inputs)
        # The storage session of the run's kept outputs (the answer's session_id), and
        # those outputs (files, artifact_delivery) once stored.
        session_id = api.new_id()
        outputs: list[Delivered] = []
        deleted: list[str] = []

        async def collect(handle: SandboxHandle, files: list[OutputFile]) -> None:
            # Stored while the turn holds its sandbox, before the turn commits: a keyed
            # turn's commit stores the answer, and the answer names these files.
            await kept.collect(handle, files)
            outputs[:] = [await keep_outputs(api, caller, owner, session_id, files, inputs, kept)]
            if inputs:
                names = [item.wire.name for item in inputs]
                deleted[:] = await deleted_inputs(handle, names, files)

        def built(result: ExecuteResult) -> bytes | None:
            """The answer to ``result`` (None: a timeout, answered 504 and never kept)."""
            if result.status == RunStatus.TIMEOUT:
                return None
            files, delivery = outputs[0] if outputs else ([], None)
            answer = _answer(result, session_id, files, delivery)
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
        claim = await api.idempotency.claim(
            surface="librechat/exec",
            namespace=scope,
            key=idempotency_key(request),
            body=raw,
            # Its answer's bytes (file ids and all) are kept in the store too.
            stateless=api.execution.runs_stateless(hint),
        )
        if isinstance(claim, IdempotencyConflict):
            return claim.response()
        if isinstance(claim, Replay):
            return replayed(
                Response(claim.body, status_code=claim.status, media_type=JSON_MEDIA_TYPE)
            )

        async def answered() -> bytes:
            nonlocal existed
            async with api.limiter.slot(caller.namespace):
                if hint is not None:
                    # Looked up before the turn (which makes the record): a session
                    # with one has its /mnt/data (warm, or from its checkpoint).
                    record = await api.manager.record(
                        runtime_session_id(caller.namespace, user, hint)
                    )
                    existed = record is not None
                try:
                    # A keyed session turn: its answer goes with the fenced record write
                    # that commits it (exactly once, as /v1/exec's), and into the store.
                    result = await api.execution.execute(
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
            unanswered=lambda: drop_outputs(api, caller, session_id, outputs),
        )
        # A caller that leaves takes its run with it (the job is stopped, a session
        # keeps what it wrote until then), as on /v1/exec: nobody reads the answer.
        # A keyed run goes on to its end, for the retry its client said would come.
        kept_body = await run_until_disconnect(request, run_kept, detached=claim.key is not None)
        if kept_body is None:
            return Response(status_code=499)
        return Response(kept_body, media_type=JSON_MEDIA_TYPE)

    async def _exec_caller(self, request: Request) -> tuple[Caller, bytes]:
        """The caller and the body: by the headers, else by a legacy body key.

        A call its headers do not authenticate is a stranger until its key is found:
        it gets at most ``BODY_KEY_MAX_BYTES`` read and only the key decoded, and
        every failure (too long, not JSON, no key, a wrong one) is the same 401.
        """
        auth = self._api.auth
        caller = auth.header_caller(request)
        if caller is not None:
            return caller, await read_body(request)
        try:
            raw = await read_body(request, max_bytes=BODY_KEY_MAX_BYTES)
            key = msgspec.json.decode(raw, type=_BodyKey).LIBRECHAT_CODE_API_KEY
        except (PayloadTooLargeError, msgspec.MsgspecError):
            raise UnauthorizedError from None
        return auth.body_key_caller(key), raw


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
