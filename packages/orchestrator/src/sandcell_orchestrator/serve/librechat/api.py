"""The state every route of ``/librechat/v1`` shares: ``LibreChatApi``.

Built once by ``install_librechat``: the settings, who may call (``auth``), the
tenant limiter, the idempotency store, and the process's services resolved
lazily (one ``ExecutionService`` over its ``SandboxManager``, files on its
``InputStore``). It also answers the per-call questions every run route asks:
whose run it is (``user_of``/``owner_of``) and its time limit (``timeout_s``).
The routes themselves are ``exec_routes``, ``file_routes`` and ``programmatic``.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request

from sandcell_protocol import validate_user_id

from ...bootstrap import Services
from ...metrics import Metrics
from ...sessions.execution import ExecutionService
from ...sessions.manager import SandboxManager
from ..idempotency import Idempotency
from .auth import Caller, LibreChatAuth
from .files import LibreChatFiles
from .ids import new_nanoid
from .limits import TenantLimiter
from .settings import LibreChatSettings

__all__ = ["DEFAULT_USER", "LibreChatApi"]

DEFAULT_USER = "anonymous"


class LibreChatApi:
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

    @property
    def manager(self) -> SandboxManager:
        """The process's ``SandboxManager`` (records, metrics)."""
        return self._services().manager

    @property
    def metrics(self) -> Metrics:
        return self._services().manager.metrics

    def new_id(self) -> str:
        """A fresh nanoid (the injected generator)."""
        return self._new_id()

    @property
    def files(self) -> LibreChatFiles:
        if self._files is None:
            self._files = LibreChatFiles(self._services().inputs)
        return self._files

    def user_of(self, caller: Caller, request: Request, named: str | None) -> str:
        """The run's user: the token's, else the one the call names, else a default.

        Checked whether or not the call names a runtime session: the user is kept
        with the run's output files either way."""
        return self.owner_of(caller, request, named) or DEFAULT_USER

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
