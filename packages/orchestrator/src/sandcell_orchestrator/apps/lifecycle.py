"""Keeping app instances alive, letting idle ones go, and reporting new runtime errors.

``InstanceSupervisor.running()`` runs three loops:

``health``  every ``health_interval_s``: ask each instance's runner for ``/health``
            and its dev server's state. A runner that does not answer is
            *recovered*: its sandbox is recreated from the last checkpoint
            (``SandboxManager.resume``) and the dev server restarted; the instance
            keeps its id, preview URL and token. A dev server that exited is
            restarted. A healthy instance changed since its last checkpoint is
            checkpointed, so a recovery loses at most one interval of work.
``idle``    instances with no API call or preview request for ``idle_timeout_s``
            are shut down (sandbox and checkpoint destroyed).
``errors``  every ``error_poll_s``, or at once when the preview relayed a browser
            report (``poke``): runtime-error fingerprints not seen before on an
            instance with a ``webhook_url`` are queued as webhooks.

An instance busy with an API call is skipped by a round (its lock is held):
being used is a better health signal than a ping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

from ..errors import (
    SandboxNotFoundError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SandcellError,
)
from . import provision
from .client import AppRunnerClient
from .instance import Instance
from .instances import AppInstances
from .webhooks import Delivery

__all__ = ["InstanceSupervisor"]

log = logging.getLogger(__name__)

_GONE = (SandboxUnavailableError, SandboxTimeoutError, SandboxNotFoundError, TimeoutError)
"""What a health probe raises when the runner is gone, rather than misbehaving."""


class InstanceSupervisor:
    """Health, recovery, idle shutdown and webhooks of one ``AppInstances``."""

    def __init__(self, instances: AppInstances, *, health_timeout_s: float = 10.0) -> None:
        self._instances = instances
        self._settings = instances.settings
        self._health_timeout_s = health_timeout_s
        self._wake = asyncio.Event()

    def __repr__(self) -> str:
        return f"InstanceSupervisor({self._instances!r})"

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[InstanceSupervisor]:
        """Run the loops for the duration of the block."""
        idle_tick_s = min(self._settings.idle_timeout_s / 4, 30.0)
        loops = {
            "health": (self._settings.health_interval_s, self.health_round),
            "idle": (idle_tick_s, self.idle_round),
        }
        tasks = [
            asyncio.create_task(self._every(interval, step), name=f"sandcell-apps-{name}")
            for name, (interval, step) in loops.items()
        ]
        tasks.append(asyncio.create_task(self._errors_forever(), name="sandcell-apps-errors"))
        try:
            yield self
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _every(self, interval_s: float, step: Callable[[], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except Exception:
                log.exception("app instance %s round failed", getattr(step, "__name__", "?"))

    # -- health ------------------------------------------------------------------------

    async def health_round(self) -> dict[str, str]:
        """Check every instance once; returns ``{instance_id: outcome}``."""
        return {item.instance_id: await self.check(item) for item in self._instances.all()}

    async def check(self, instance: Instance) -> str:
        """One health check: ``healthy``, ``restarted``, ``recovered``, ``busy`` or ``failed``."""
        if instance.lock.locked():
            return "busy"
        async with instance.lock:
            if instance.status == "stopped":
                return "busy"
            try:
                outcome = await self._check_locked(instance)
            except SandcellError as exc:
                instance.status = "degraded"
                log.warning("app instance %s: health check failed: %s", instance.instance_id, exc)
                return "failed"
            instance.status = "ready"
            return outcome

    async def _check_locked(self, instance: Instance) -> str:
        try:
            with anyio.fail_after(self._health_timeout_s):
                await instance.handle.runner.health()
                process = await instance.runner.process(provision.DEV_TAG)
        except _GONE as exc:
            log.warning(
                "app instance %s: runner unreachable (%s); recovering from its checkpoint",
                instance.instance_id,
                type(exc).__name__,
            )
            await self.recover(instance)
            return "recovered"
        outcome = "healthy"
        if process is None or process.state == "exited":
            log.warning("app instance %s: dev server exited; restarting", instance.instance_id)
            instance.status = "starting"
            await provision.start_dev_server(instance.runner, instance.manifest, instance.env)
            await provision.wait_ready(
                instance.runner, instance.manifest, clock=self._instances.clock
            )
            outcome = "restarted"
        if instance.dirty:
            try:
                await self._instances.checkpoint(instance)
            except SandcellError as exc:
                # Fail open on speed: the previous checkpoint stays the recovery point.
                log.warning("app instance %s: checkpoint failed: %s", instance.instance_id, exc)
        return outcome

    async def recover(self, instance: Instance) -> None:
        """Recreate the sandbox from its last checkpoint and restart the dev server.

        Call with the instance's lock held. ``SandboxManager.replace_lost`` keeps
        the row resumable by the next round if any step fails.
        """
        instance.status = "recovering"
        handle = await self._instances.manager.replace_lost(instance.session_id, instance.spec())
        old_handle, old_runner = instance.handle, instance.runner
        # The old clients stay usable (failing cleanly) until the new ones are in place.
        instance.handle, instance.runner = handle, AppRunnerClient.for_handle(handle)
        await old_runner.close()
        await old_handle.close()
        await provision.start_dev_server(instance.runner, instance.manifest, instance.env)
        await provision.wait_ready(instance.runner, instance.manifest, clock=self._instances.clock)
        log.info("app instance %s recovered into a new sandbox", instance.instance_id)

    # -- idle ----------------------------------------------------------------------------

    async def idle_round(self) -> list[str]:
        """Shut down instances idle for ``idle_timeout_s``; returns their ids."""
        now = self._instances.clock()
        stopped = []
        for instance in self._instances.all():
            idle = now - instance.last_active >= self._settings.idle_timeout_s
            if idle and not instance.lock.locked():
                log.info("app instance %s idle; shutting it down", instance.instance_id)
                await self._instances.shutdown(instance)
                stopped.append(instance.instance_id)
        return stopped

    # -- runtime errors → webhooks -------------------------------------------------------

    def poke(self) -> None:
        """Look for new runtime errors now (the preview relayed a browser report)."""
        self._wake.set()

    async def _errors_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settings.error_poll_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.errors_round()
            except Exception:
                log.exception("app instance runtime-error round failed")

    async def errors_round(self) -> int:
        """Queue a webhook per new fingerprint; returns how many were queued."""
        queued = 0
        for instance in self._instances.all():
            queued += await self.report_new_errors(instance)
        return queued

    async def report_new_errors(self, instance: Instance) -> int:
        """Queue webhooks for ``instance``'s fingerprints not reported before."""
        webhooks = self._instances.webhooks
        if instance.webhook_url is None or webhooks is None or instance.status == "stopped":
            return 0
        try:
            with anyio.fail_after(self._health_timeout_s):
                found = await instance.runner.runtime_errors()
        except (SandcellError, TimeoutError):
            return 0  # the health loop deals with a runner that is gone
        queued = 0
        for record in found.errors:
            if record.fingerprint in instance.seen_errors:
                continue
            instance.seen_errors.add(record.fingerprint)
            payload = {"instance_id": instance.instance_id, "error": instance.diagnostic(record)}
            if webhooks.submit(Delivery(url=instance.webhook_url, payload=payload)):
                queued += 1
        return queued
