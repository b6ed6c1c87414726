"""ExecutionService.run_code: cells in code contexts through the session turn.

Real local runners, the in-process registry and a snapshot directory. One
service per module keeps the runner start-ups to a few.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from sandcell_orchestrator.errors import (
    ContextLostError,
    RunnerRequestError,
    SandboxUnavailableError,
    SessionRequiredError,
)
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.execution import ExecutionService, Identity
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from sandcell_protocol import ExecuteRequest, InlineFile, runtime_session_id
from sandcell_protocol import contexts as cx
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.sessions.conftest import runner_pids

USER = Identity(namespace="tenant-ctx", user_id="u1")

pytestmark = pytest.mark.asyncio(loop_scope="module")


ROOTS: list[Path] = []


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service() -> AsyncIterator[ExecutionService]:
    with traversable_dir("ctx-orch-") as root:
        ROOTS.append(root)
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
        async with DirectorySnapshotStore(root / "snapshots") as store:
            execution = ExecutionService(
                provider=provider, registry=InProcessRegistry(), store=store
            )
            try:
                yield execution
            finally:
                await execution.aclose(destroy_sandboxes=True)
                await provider.close()
                for child in (root / "rt").iterdir():
                    await provider.destroy(child.name)


def python(code: str, **fields: object) -> ExecuteRequest:
    return ExecuteRequest(language="python", code=code, **fields)  # type: ignore[arg-type]


def main_text(result: cx.ContextRunResult) -> str:
    assert result.status is cx.ContextStatus.OK, result
    (main,) = [r for r in result.results if r.is_main_result]
    text: str = main.data["text/plain"]
    return text


async def test_variables_persist_in_the_default_context(service: ExecutionService) -> None:
    first = await service.run_code(python("x = 41"), USER, hint="persist")
    assert (first.status, first.results) == (cx.ContextStatus.OK, [])
    assert main_text(await service.run_code(python("x + 1"), USER, hint="persist")) == "42"
    session_id = runtime_session_id(USER.namespace, USER.user_id, "persist")
    listed = await service.contexts.list(session_id)
    assert [(c.context_id, c.execution_count) for c in listed] == [("default-python", 2)]


async def test_named_contexts_are_separate_and_events_stream(service: ExecutionService) -> None:
    await service.run_code(python("v = 'a'"), USER, hint="named", context_id="one")
    other = await service.run_code(python("v"), USER, hint="named", context_id="two")
    assert other.error is not None
    assert other.error.name == "NameError"
    seen: list[cx.ContextEvent] = []
    result = await service.run_code(
        python("print('out')\nv"), USER, hint="named", context_id="one", on_event=seen.append
    )
    assert [type(e).__name__ for e in seen] == [
        "ContextStdoutEvent",
        "ContextResultEvent",
        "ContextEndEvent",
    ]
    assert (result.stdout, main_text(result)) == ("out\n", "'a'")


async def test_inputs_arrive_and_changed_files_are_checkpointed(
    service: ExecutionService,
) -> None:
    session_id = runtime_session_id(USER.namespace, USER.user_id, "files")
    data = InlineFile(name="in.txt", content_b64=base64.b64encode(b"given").decode())
    result = await service.run_code(
        python(
            "text = open('in.txt').read()\nopen('out.txt', 'w').write(text * 2)\ntext",
            inline_files=[data],
        ),
        USER,
        hint="files",
    )
    assert main_text(result) == "'given'"
    assert [f.name for f in result.files] == ["out.txt"]
    first = await service.manager.current_checkpoint(session_id)
    assert first is not None
    # A cell that changes no file makes no new checkpoint.
    await service.run_code(python("len(text)"), USER, hint="files")
    assert await service.manager.current_checkpoint(session_id) == first
    await service.run_code(python("open('more.txt', 'w').write('x')"), USER, hint="files")
    assert await service.manager.current_checkpoint(session_id) != first


async def test_after_a_restore_into_a_new_sandbox_the_context_is_lost(
    service: ExecutionService,
) -> None:
    """Files come back from the checkpoint; variables do not, and the run says so."""
    session_id = runtime_session_id(USER.namespace, USER.user_id, "suspend")
    await service.run_code(
        python("y = 1\nopen('kept.txt', 'w').write('kept')"), USER, hint="suspend"
    )
    assert await service.suspend_session(session_id)
    with pytest.raises(ContextLostError, match="context_lost"):
        await service.run_code(python("y"), USER, hint="suspend")
    info = await service.contexts.restart(session_id, "default-python")
    assert info.state == "idle"
    assert (
        main_text(await service.run_code(python("open('kept.txt').read()"), USER, hint="suspend"))
        == "'kept'"
    )


async def test_a_dead_warm_sandbox_fails_retryably_then_answers_context_lost(
    service: ExecutionService,
) -> None:
    """A cell skips the /health check; a sandbox that died meanwhile fails that cell
    (retryable, nothing ran) and the next one restores the files: context_lost."""
    session_id = runtime_session_id(USER.namespace, USER.user_id, "dead")
    await service.run_code(python("z = 1\nopen('z.txt', 'w').write('z')"), USER, hint="dead")
    record = await service.manager.record(session_id)
    assert record is not None
    (pid,) = runner_pids(ROOTS[-1] / "rt" / record.sandbox_id)
    os.killpg(pid, signal.SIGKILL)
    with pytest.raises(SandboxUnavailableError) as info:
        await service.run_code(python("z"), USER, hint="dead")
    assert info.value.retryable
    with pytest.raises(ContextLostError):
        await service.run_code(python("z"), USER, hint="dead")
    await service.contexts.restart(session_id, "default-python")
    assert (
        main_text(await service.run_code(python("open('z.txt').read()"), USER, hint="dead"))
        == "'z'"
    )


async def test_interrupt_reaches_a_running_cell(service: ExecutionService) -> None:
    session_id = runtime_session_id(USER.namespace, USER.user_id, "interrupt")
    await service.run_code(python("n = 3"), USER, hint="interrupt")
    running = asyncio.create_task(
        service.run_code(python("while True:\n    pass"), USER, hint="interrupt")
    )
    for _ in range(200):
        listed = await service.contexts.list(session_id)
        if any(c.state == "busy" for c in listed):
            break
        await asyncio.sleep(0.05)
    await service.contexts.interrupt(session_id, "default-python")
    result = await asyncio.wait_for(running, 30)
    assert result.error is not None
    assert result.error.name == "KeyboardInterrupt"
    assert main_text(await service.run_code(python("n"), USER, hint="interrupt")) == "3"


async def test_contexts_need_a_session_and_refuse_program_fields(
    service: ExecutionService,
) -> None:
    with pytest.raises(SessionRequiredError):
        await service.run_code(python("1"), USER, hint=None)
    with pytest.raises(RunnerRequestError, match="args, stdin") as info:
        await service.run_code(python("1", args=["a"], stdin="x"), USER, hint="refuse")
    assert info.value.code == "bad_request"
