"""``run_stateless``: one job in a sandbox of its own, discarded after it.

No session, no registry row, nothing kept: launch, deliver the inputs, execute,
discard, also on cancel and error (``execution.py`` chooses this path).
"""

from __future__ import annotations

import secrets

from sandcell_protocol import ExecuteRequest, ExecuteResult

from ..providers.base import SandboxSpec
from .inputs import InputSource, deliver_inputs
from .manager import SandboxManager
from .output import Collect, OnOutput, run_job
from .sandboxes import rebind

__all__ = ["run_stateless"]


async def run_stateless(
    manager: SandboxManager,
    request: ExecuteRequest,
    *,
    spec: SandboxSpec,
    inputs: InputSource | None,
    timeout_s: float,
    on_output: OnOutput | None,
    collect: Collect | None,
) -> ExecuteResult:
    """Run ``request`` in a new sandbox of ``spec``, then discard the sandbox."""
    with manager.metrics.timer("sandcell_turn_duration_seconds"):
        handle = await manager.launch(spec)
        # A job's own workspace is gone when it ends; one that ``collect`` reads runs in
        # a throwaway runtime session instead, whose workspace lasts until the discard.
        job = handle if collect is None else rebind(handle, "rt_" + secrets.token_hex(32))
        try:
            await deliver_inputs(job, request, session_id=job.session_id, source=inputs)
            result = await run_job(
                job,
                request,
                session_id=job.session_id,
                timeout_s=timeout_s,
                on_output=on_output,
            )
            if collect is not None:
                await collect(job, result.files)
            await manager.count_egress(handle)
        finally:
            await manager.discard(handle)
        manager.metrics.inc("sandcell_executions_total", status=str(result.status))
        return result
