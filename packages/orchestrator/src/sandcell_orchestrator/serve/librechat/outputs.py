"""A run's output files as LibreChat keeps them: every one, up to a byte cap per run.

The runner inlines an output only up to ``SANDCELL_RUNNER_OUTPUT_INLINE_BYTES``
(1 MiB by default); a bigger one is listed without its bytes. LibreChat's client
expects every file a run produced to be downloadable afterwards, so
``KeptOutputs.collect`` (the ``ExecutionService`` hook, called after the job and
before the sandbox is released or discarded) reads those from the sandbox.

What one run keeps is bounded by ``SANDCELL_LIBRECHAT_MAX_OUTPUT_BYTES``, inline
outputs included, in the order the runner lists them; the bytes are read while
the run still holds its tenant's concurrency slot and its turn, so their cost is
the run's. An output that does not fit is not kept: the answer's
``artifact_delivery`` (code ``artifact_delivery_failed``, the one the client reads)
names it in ``errors`` with the code ``output_limit_exceeded``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sandcell_protocol import OutputFile, is_escaped_name

from ...errors import SandcellError
from ...handle import SandboxHandle
from ...metrics import Metrics

__all__ = [
    "DELIVERY_FAILED_CODE",
    "LIMIT_CODE",
    "READ_FAILED_CODE",
    "KeptOutputs",
    "Refusal",
    "deleted_inputs",
]

log = logging.getLogger(__name__)

LIMIT_CODE = "output_limit_exceeded"
"""An output not kept because the run's outputs passed the byte cap."""
READ_FAILED_CODE = "artifact_delivery_failed"
"""An output not kept because it could not be read from the sandbox."""
DELIVERY_FAILED_CODE = "artifact_delivery_failed"
"""The code of ``artifact_delivery`` itself, whatever its errors' codes: the only one
``@librechat/agents`` accepts (it drops a summary with another, and so never warns the
model that files are missing)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why one output was not kept."""

    code: str
    message: str


@dataclass
class KeptOutputs:
    """One run's outputs over the inline cap, read from its sandbox, within ``max_bytes``.

    ``skip`` names the outputs that are never kept (the read-only inputs, which are
    echoed). A name reported again (a later round of a programmatic run) replaces
    what was kept for it, and its charge.
    """

    max_bytes: int
    skip: frozenset[str] = frozenset()
    metrics: Metrics | None = None
    _charged: dict[str, int] = field(default_factory=dict)
    _read: dict[str, bytes] = field(default_factory=dict)
    _refused: dict[str, Refusal] = field(default_factory=dict)

    @property
    def used(self) -> int:
        """The bytes this run keeps so far."""
        return sum(self._charged.values())

    async def collect(self, handle: SandboxHandle, files: list[OutputFile]) -> None:
        """Charge every output to the cap; read the ones the runner did not inline."""
        for output in files:
            if output.symlink_target is not None or output.name in self.skip:
                continue
            self._charged.pop(output.name, None)
            self._read.pop(output.name, None)
            self._refused.pop(output.name, None)
            if self.used + output.size > self.max_bytes:
                self._refused[output.name] = Refusal(
                    LIMIT_CODE,
                    f"{output.size} bytes: over the {self.max_bytes}-byte cap on one run's"
                    " kept outputs (SANDCELL_LIBRECHAT_MAX_OUTPUT_BYTES)",
                )
                continue
            if output.content_b64 is not None or output.size == 0:
                self._charged[output.name] = output.size
                continue
            await self._fetch(handle, output)

    async def _fetch(self, handle: SandboxHandle, output: OutputFile) -> None:
        if is_escaped_name(output.name):
            # Its real name is not UTF-8: the file routes cannot name it.
            self._refused[output.name] = Refusal(READ_FAILED_CODE, "its name is not UTF-8")
            return
        try:
            data = await handle.files.read_bytes(output.name)
        except SandcellError as exc:
            log.warning("output not read from the sandbox: %s", type(exc).__name__)
            self._refused[output.name] = Refusal(READ_FAILED_CODE, "it could not be read")
            return
        if self.used + len(data) > self.max_bytes:
            # It grew after it was listed (a process still writing it).
            self._refused[output.name] = Refusal(
                LIMIT_CODE,
                f"{len(data)} bytes: over the {self.max_bytes}-byte cap on one run's"
                " kept outputs (SANDCELL_LIBRECHAT_MAX_OUTPUT_BYTES)",
            )
            return
        self._charged[output.name] = len(data)
        self._read[output.name] = data
        if self.metrics is not None:
            self.metrics.inc("sandcell_librechat_fetched_output_bytes_total", len(data))

    def bytes_of(self, output: OutputFile) -> bytes | None:
        """What was read for ``output`` (None: inline, refused, or never collected)."""
        return self._read.get(output.name)

    def refusal(self, output: OutputFile) -> Refusal | None:
        """Why ``output`` is not kept, if it was refused."""
        return self._refused.get(output.name)


async def deleted_inputs(
    handle: SandboxHandle, inputs: list[str], outputs: list[OutputFile]
) -> list[str]:
    """The input names the job removed from its workspace (the answer's ``deleted_files``).

    The client drops a file from its conversation's session only when an answer names
    it here (absence from ``files`` is no signal), so without it a file the code deleted
    comes back in the next call. One listing per directory of an input; a name is said
    deleted only when a listing shows it gone (a listing that fails says nothing, but
    the directory itself gone from a root listing that succeeds)."""
    written = {output.name for output in outputs}
    by_dir: dict[str, set[str]] = {}
    for name in inputs:
        if name not in written:
            parent, _, leaf = name.rpartition("/")
            by_dir.setdefault(parent, set()).add(leaf)
    root: set[str] | None = None
    deleted: list[str] = []
    for parent in sorted(by_dir):
        try:
            present = {entry.name for entry in await handle.files.list(parent)}
        except SandcellError:
            if not parent:
                continue
            if root is None:
                try:
                    root = {entry.name for entry in await handle.files.list("")}
                except SandcellError:
                    continue
            if parent.split("/", 1)[0] in root:
                continue  # the directory is there: the listing failed for another reason
            present = set()
        deleted += sorted(
            f"{parent}/{leaf}" if parent else leaf for leaf in by_dir[parent] - present
        )
    return deleted
