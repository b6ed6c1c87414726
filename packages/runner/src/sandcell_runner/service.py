"""The runner as a whole: its process-wide state, the job lifecycle, and the one entry
point of the HTTP layer."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable

import msgspec

from sandcell_protocol import PROTOCOL_VERSION, ExecuteRequest, ExecuteResult, Health
from sandcell_protocol.app_messages import AnalysisResult
from sandcell_protocol.contexts import ContextEndEvent, ContextRun

from . import __version__
from .apps.manager import AppManager
from .checkpoint.export import ArchiveLimits
from .checkpoint.session import SessionCheckpoints
from .config import MIB, RunnerSettings
from .contexts.interpreter import EventCallback
from .contexts.manager import ContextManager
from .egress.manager import EgressManager, unavailable_reason
from .env_vars import checked_env
from .errors import BusyError
from .executor import Executor, PreparedRequest
from .host import prepare_host, weakened_isolation
from .inputs.cache import InputCache
from .inputs.priming import Primer
from .jail.capture import OutputCallback
from .jail.cgroup_reaper import instance_key
from .jail.instance_usage import InstanceCounters
from .jail.netns import SessionNetns
from .jail.nsjail import Jail
from .jail.spawn_helper import SpawnHelper
from .jail.uidpool import UidPool
from .languages import LanguageSpec, discover_languages
from .outputs import OutputCollector
from .sandbox.metrics import MetricsSampler
from .sandbox.sessions import SandboxSessions
from .upkeep import Upkeep
from .warmup import Warmup
from .workspace.files import SessionFiles
from .workspace.jobs import JobWorkspaces
from .workspace.manager import JobWorkspace
from .workspace.session import SessionManager, SessionState

log = logging.getLogger(__name__)


class RunnerService:
    """Everything a runner process holds; built once at start-up.

    The HTTP layer's one entry point. Routes call its methods (``prepare``,
    ``execute``, ``run_in_context``, ``analyse``, ``health``, ``running``) and its
    feature objects: ``sessions`` (binding), ``files``, ``checkpoints``, ``inputs``,
    ``apps``, ``contexts``, ``sandbox`` and ``metrics``.
    The machinery behind them (executor, jail, workspaces, cgroups, UIDs, warmup)
    is its own.
    """

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        languages: dict[str, LanguageSpec] | None = None,
    ) -> None:
        self.settings = settings
        self.warnings: list[str] = []
        nsjail = settings.nsjail_path if settings.jail_mode == "nsjail" else None
        # The one forker of jailed processes (jail/spawner.py says why there is no other).
        # Launched first and awaited last: its interpreter start (~25 ms), the job-user
        # probe (an nsjail run, ~12 ms) and the first workspace image (mkfs and mount,
        # 8-45 ms) were one after another on every cold session's path. Launched from
        # this thread, which its death signal follows.
        self._spawner = SpawnHelper(vfork=settings.spawn_vfork, wait=False)
        try:
            host = prepare_host(settings, nsjail, self._spawner)
        except BaseException:
            self._spawner.close()
            raise
        self._workspaces = host.workspaces
        self._cgroups = host.cgroups
        self._lease = host.lease
        self.warnings += host.warnings
        job_user_refused = host.job_user_refused
        self._jail = Jail(
            nsjail=nsjail,
            cgroups=self._cgroups,
            spawner=self._spawner,
            as_job_user=job_user_refused is None,
        )
        self._uids = UidPool(settings.uid_min, settings.uid_max, keep_leased=settings.max_jobs)
        self.languages = (
            languages if languages is not None else discover_languages(jailed=self._jail.jailed)
        )
        # Output scanning has threads of its own, one per job slot: it never queues
        # behind, or holds up, the default executor every other request hops through.
        self._outputs = OutputCollector(
            inline_max_bytes=settings.output_inline_bytes,
            max_files=settings.max_output_files,
            scan_budget_bytes=settings.output_scan_bytes,
            threads=settings.max_jobs,
        )
        self._executor = Executor(
            settings,
            jail=self._jail,
            workspaces=self._workspaces,
            languages=self.languages,
            outputs=self._outputs,
        )
        self.inputs = InputCache(
            settings.input_cache_dir,
            max_object_bytes=settings.input_max_object_bytes,
            file_server_url=settings.file_server_url,
        )
        self._primer = Primer(self.inputs)
        self.apps = AppManager(
            settings, jail=self._jail, workspaces=self._workspaces, languages=self.languages
        )
        self.egress = EgressManager(
            settings.egress,
            unavailable=unavailable_reason(
                jailed=self._jail.jailed, allow_network=settings.allow_network
            ),
            state_dir=settings.workspace_root.parent / "egress",
        )
        self.sessions = SessionManager(
            enabled=settings.sessions_enabled,
            workspaces=self._workspaces,
            uids=self._uids,
            wait_ms=settings.session_wait_ms,
            netns_factory=self._session_netns if settings.sessions_enabled else None,
        )
        self.contexts = ContextManager(
            settings, jail=self._jail, workspaces=self._workspaces, languages=self.languages
        )
        # A session's processes and interpreters end before its workspace is wiped, and
        # its jobs share its network namespace.
        self.sessions.release_hooks.append(self.apps.release)
        self.sessions.release_hooks.append(self.contexts.release)
        python = self.languages.get("python")
        self.sandbox = SandboxSessions(
            settings,
            jail=self._jail,
            workspaces=self._workspaces,
            python=python.binary if python else None,
        )
        self.sessions.release_hooks.append(self.sandbox.release)
        self.metrics = MetricsSampler(
            settings,
            cgroups=InstanceCounters(self._cgroups),
            workspaces=self._workspaces,
            sessions=self.sessions,
        )
        self.sessions.release_hooks.append(self._release_egress)
        self._jail.netns_for = self.sessions.netns_fd_for
        self._jail.egress_for = self.egress.apply
        self.egress.start()
        self.files = SessionFiles(self.sessions, max_read_bytes=settings.max_body_bytes)
        self.checkpoints = SessionCheckpoints(
            self.sessions,
            limits=ArchiveLimits(
                max_bytes=settings.checkpoint_max_bytes,
                max_members=settings.checkpoint_max_members,
            ),
            cgroups=self._cgroups,
            memory_bytes=settings.limits.memory_mib * MIB,
        )
        # A restore replaces the workspace the interpreters run in: their state is gone.
        self.checkpoints.restore_hooks.append(self._lose_contexts)
        self._warmup = Warmup(settings.warmup_command)
        self._slots = asyncio.Semaphore(settings.max_jobs)
        self._jobs = JobWorkspaces(self._workspaces, self._uids, self.sessions)
        self._upkeep = Upkeep(
            settings,
            workspaces=self._workspaces,
            cgroups=self._cgroups,
            sessions=self.sessions,
            jobs=self._jobs,
            contexts=self.contexts,
            keepers=(self.sessions, self._jobs, self.apps, self.contexts, self.sandbox),
        )
        self._collect_warnings()

    def _session_netns(self) -> SessionNetns | None:
        """A bound session's namespace, linked for egress when the policy lets anything out."""
        netns = self.apps.create_netns()
        self.egress.session_netns(netns)
        return netns

    async def _release_egress(self, state: SessionState) -> None:
        await asyncio.to_thread(self.egress.session_released, state.netns)

    def _collect_warnings(self) -> None:
        self.warnings += weakened_isolation(
            self.settings,
            jail=self._jail,
            cgroups=self._cgroups,
            workspaces=self._workspaces,
            uids=self._uids,
        )
        for warning in self.warnings:
            log.warning("weakened isolation: %s", warning)

    @contextlib.asynccontextmanager
    async def _job_slot(self) -> AsyncIterator[None]:
        """One of ``SANDCELL_RUNNER_MAX_JOBS`` slots, or ``BusyError`` (503) at once."""
        if self._slots.locked():
            raise BusyError(f"runner at its concurrency limit ({self.settings.max_jobs} jobs)")
        async with self._slots:
            yield

    def prepare(self, request: ExecuteRequest) -> PreparedRequest:
        """Validate everything about a request before anything is written; raises a 4xx."""
        return self._executor.prepare(request)

    async def execute(
        self,
        prepared: PreparedRequest,
        *,
        session_id: str | None = None,
        on_output: OutputCallback | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> ExecuteResult:
        """Run a request start to finish (in the session's workspace when given).

        The one path of every execution, answered as JSON or streamed. Refusals
        (busy, session busy, input missing) are raised before ``on_started`` is
        called, which is when the slot, the workspace and the inputs are ready and
        the jail is about to run; ``on_output`` then gets the output as it comes.
        """
        self.sessions.require_not_quarantined()

        def fill(workspace: JobWorkspace) -> None:
            self._executor.write_inputs(prepared, workspace)

        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self._job_slot())
            if session_id is not None:
                workspace = await stack.enter_async_context(self._jobs.session(session_id, fill))
                primed = self.sessions.bound.primed if self.sessions.bound else None
            else:
                workspace = await stack.enter_async_context(
                    self._jobs.fresh(fill, small=_small_inputs(prepared))
                )
                primed = None
            await self._primer.prime(prepared.refs, workspace, primed=primed)
            if on_started is not None:
                on_started()
            return await self._executor.run_in(prepared, workspace, on_output=on_output)

    async def run_in_context(
        self,
        session_id: str,
        context_id: str,
        request: ContextRun,
        *,
        on_event: EventCallback,
        on_started: Callable[[], None] | None = None,
    ) -> ContextEndEvent:
        """Run a cell in one of the session's contexts: a job (a slot, the session lock).

        Refusals (busy, session busy, unknown or lost context) are raised before
        ``on_started``; the events then go to ``on_event``, the end event is returned.
        """
        self.sessions.require_not_quarantined()
        self.contexts.check_runnable(session_id, context_id)
        # A bad env is the caller's 400: refused here, before a stream's 200 has begun.
        checked_env(request.env)
        async with self._job_slot(), self.sessions.locked(session_id) as state:
            self.contexts.check_runnable(session_id, context_id)
            if on_started is not None:
                on_started()
            end = await self.contexts.run(state, context_id, request, on_event)
            # What the cell wrote, as an execute reports it (and whether to checkpoint).
            workspace = JobWorkspace(
                path=state.workspace,
                uid=state.uid,
                gid=state.uid,
                job_dir=state.workspace,
                surfaced=state.surfaced,
                session_id=session_id,
            )
            before = len(state.surfaced)
            collected = await self._executor.collect_outputs(workspace)
            changed = (
                bool(collected.files) or collected.removed > 0 or len(state.surfaced) != before
            )
            return msgspec.structs.replace(end, files=collected.files, workspace_changed=changed)

    async def analyse(self, session_id: str) -> AnalysisResult:
        """Static analysis of the session's workspace: a job, so it takes a slot and the lock."""
        async with self._job_slot(), self._jobs.session(session_id) as workspace:
            return await self.apps.analyzer.analyse(workspace)

    def health(self) -> Health:
        """What ``/health`` answers: state, versions, warmup, languages, weakened isolation."""
        sessions = self.sessions
        return Health(
            status="quarantined" if sessions.quarantined else "ok",
            protocol=PROTOCOL_VERSION,
            runner_version=__version__,
            session_id=sessions.bound.session_id if sessions.bound else None,
            warmup=self._warmup.state,
            languages=sorted(self.languages),
            warnings=list(self.warnings),
            egress=self.egress.mechanism,
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The service while it serves: warmup and the upkeep run; shut down on exit."""
        # Everything made until now (imports, the service) lives as long as the runner:
        # out of the collector's sight, a full collection walks a few thousand objects
        # instead of ~46,000. Measured with gc.callbacks at 16 clients (`bash: true`,
        # 2026-12-07): the collector took 90 us of the runner's CPU a request (6.4 %),
        # 65 of it a 28 ms full collection every ~400 requests (a p99 spike too); 25 us
        # frozen. No ``gc.collect()`` first: it would cost a cold start those 28 ms.
        gc.freeze()
        self._warmup.start()
        self.checkpoints.extractors.start()
        reaper = asyncio.create_task(self._upkeep.reaper_loop(), name="sandcell-reaper")
        idle = asyncio.create_task(self._upkeep.idle_loop(), name="sandcell-idle")
        metrics = asyncio.create_task(self.metrics.run(), name="sandcell-metrics")
        try:
            yield
        finally:
            for task in (reaper, idle, metrics):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self._warmup.stop()
            await self.shutdown()

    async def _lose_contexts(self, state: SessionState) -> None:
        await self.contexts.restored(state)

    def note_request(self) -> None:
        """A request arrived (the idle exit counts from the last one)."""
        self._upkeep.note_request()

    async def shutdown(self) -> None:
        """Stop session processes, then wipe the bound session (tmpfs workspaces hold memory)."""
        await self._jobs.drain()
        with contextlib.suppress(Exception):
            await self.apps.shutdown()
        with contextlib.suppress(Exception):
            await self.contexts.shutdown()
        with contextlib.suppress(Exception):
            await self.sandbox.shutdown()
        with contextlib.suppress(Exception):
            await self.sessions.release(None)
        with contextlib.suppress(Exception):
            await self.checkpoints.extractors.aclose()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.egress.close)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._spawner.close)
            await asyncio.to_thread(self._cgroups.release_all)
        self._outputs.close()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._workspaces.close)
        self._uids.close()
        self._lease.release()


_SMALL_INPUT_BYTES = 64 * 1024
"""Inputs up to this size are written on the event loop (page-cache writes, ~100 us)."""


def _small_inputs(prepared: PreparedRequest) -> bool:
    """Whether writing the request's entry file and inline files is a few small writes."""
    if len(prepared.inline_files) > 8:
        return False
    size = len(prepared.request.code) * 4  # characters, at most 4 bytes of UTF-8 each
    size += sum(len(item.content) for item in prepared.inline_files)
    return size <= _SMALL_INPUT_BYTES


__all__ = ["RunnerService", "instance_key"]
