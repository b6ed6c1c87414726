"""A real ``sandcell serve`` whose runners serve files past the default ceiling.

The operator raised the runners' ``SANDCELL_RUNNER_MAX_BODY_BYTES`` to 96 MiB (the
local provider passes it on). A 65 MiB workspace file, past the 64 MiB the
orchestrator reads by default, is read in full through E2B's ``files.read`` once the
service's own ``SANDCELL_ANSWER_MAX_BODY_BYTES`` is raised too; without it the read
fails with a message naming that variable (and the runner's), not "retry".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from tests.e2b_api.conftest import E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers

MIB = 1 << 20
SIZE = 65 * MIB
RUNNERS = {"SANDCELL_RUNNER_MAX_BODY_BYTES": str(96 * MIB)}
MAKE = f"head -c {SIZE} /dev/zero > /home/user/big.bin"


@contextlib.contextmanager
def _served(**env: str) -> Iterator[E2bServe]:
    with traversable_dir("e2b-ceiling-") as base:
        service = start_serve(base, env={**RUNNERS, **env})
        try:
            yield service
        finally:
            stop_serve(service)
            assert not stop_leftovers(service.runtime_dir)


def test_a_raised_ceiling_reads_a_file_past_the_default_in_full() -> None:
    with _served(SANDCELL_ANSWER_MAX_BODY_BYTES=str(96 * MIB)) as served:
        sandbox = Sandbox.create(**served.opts())
        try:
            sandbox.commands.run(MAKE)
            data = sandbox.files.read("/home/user/big.bin", format="bytes")
            assert (len(data), data.count(0)) == (SIZE, SIZE)
        finally:
            sandbox.kill()


def test_the_default_ceiling_names_the_variable_to_raise() -> None:
    with _served() as served:
        sandbox = Sandbox.create(**served.opts())
        try:
            sandbox.commands.run(MAKE)
            with pytest.raises(SandboxException) as refused:
                sandbox.files.read("/home/user/big.bin", format="bytes")
            said = str(refused.value)
            assert "raise SANDCELL_ANSWER_MAX_BODY_BYTES" in said, said
            assert f"SANDCELL_RUNNER_MAX_BODY_BYTES={96 * MIB} is above" in said, said
            # The service says so once, at the first contact with such a runner.
            assert served.log().count("above this orchestrator's answer ceiling") == 1
        finally:
            sandbox.kill()
