"""What a runner states about the size of its answers: ``Health.limits`` (protocol 1.3).

The orchestrator reads every runner answer bounded (a runner in a tenant's container
or VM may have been taken over), by caps derived from these. Before 1.3 it could
only assume the runner's defaults, so a runner configured above them had answers
refused and one configured below them was read with room it never needed. A runner
now states its limits and the orchestrator follows them, never past its own
configured ceiling (a taken-over runner can state anything).

Sent only to a peer whose ``X-Sandcell-Protocol`` is at least ``LIMITS_SINCE`` (an
older one decodes ``Health`` strictly and would refuse the field); a peer that
states none (an older runner) is read with the caps its client was built with.
Fields added by a later minor must have defaults, and go only to peers of that minor.
"""

from __future__ import annotations

from .base import Message, NonNegativeInt, PositiveInt

__all__ = ["LIMITS_SINCE", "RunnerLimits"]

LIMITS_SINCE = "1.3"
"""The protocol minor that added ``Health.limits``."""


class RunnerLimits(Message, frozen=True):
    """The runner's limits that bound its answers (each its ``SANDCELL_*`` variable)."""

    timeout_ms: PositiveInt
    """``SANDCELL_RUNNER_TIMEOUT_MS``: a job's time limit when its request sets none."""
    max_timeout_ms: PositiveInt
    """``SANDCELL_RUNNER_MAX_TIMEOUT_MS``: the longest a request may ask for."""
    stdout_bytes: PositiveInt
    """``SANDCELL_RUNNER_STDOUT_BYTES``: a job's stdout kept when its request sets none."""
    max_stdout_bytes: PositiveInt
    """``SANDCELL_RUNNER_MAX_STDOUT_BYTES``: the most a request may ask for."""
    stderr_bytes: PositiveInt
    max_stderr_bytes: PositiveInt
    max_body_bytes: PositiveInt
    """``SANDCELL_RUNNER_MAX_BODY_BYTES``: the largest request body, and workspace file
    the runner serves."""
    output_inline_bytes: NonNegativeInt
    """``SANDCELL_RUNNER_OUTPUT_INLINE_BYTES``: output files up to this are inlined."""
    max_output_files: NonNegativeInt
    """``SANDCELL_RUNNER_MAX_OUTPUT_FILES``: output files one result lists at most."""
    output_scan_bytes: NonNegativeInt
    """``SANDCELL_RUNNER_OUTPUT_SCAN_BYTES``: a turn's hashed output bytes."""
    checkpoint_max_bytes: PositiveInt
    """``SANDCELL_CHECKPOINT_MAX_BYTES``: the largest checkpoint it exports or restores."""
    input_max_object_bytes: PositiveInt
    """``SANDCELL_INPUT_MAX_OBJECT_BYTES``: the largest input object it takes."""
