"""``e2b-code-interpreter``, unchanged, against ``sandcell serve``: port 49999 on code contexts.

The real SDK (sync and async) over real HTTP; the interpreter is the runner's
code context in the session's jail (numpy/pandas/matplotlib from Debian's
packages, installed by scripts/test).
"""

from __future__ import annotations

import base64

import httpx
import pytest
from e2b.exceptions import NotFoundException, SandboxException
from e2b_code_interpreter import AsyncSandbox, Context, Sandbox

from tests.e2b_api.conftest import E2bServe

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_state_carries_across_run_code(sbx: Sandbox) -> None:
    """``run_code("x = 1")`` then ``run_code("x + 41")`` is 42: one live interpreter."""
    first = sbx.run_code("x = 1")
    assert first.error is None
    second = sbx.run_code("x + 41")
    assert second.text == "42"
    assert second.results[0].is_main_result is True
    assert second.execution_count == 2


def test_output_callbacks_and_errors(sbx: Sandbox) -> None:
    """stdout/stderr reach the callbacks and the logs; an exception is ``execution.error``."""
    out: list[str] = []
    execution = sbx.run_code(
        "import sys\nprint('to out')\nprint('to err', file=sys.stderr)",
        on_stdout=lambda message: out.append(message.line),
    )
    assert execution.logs.stdout == ["to out\n"]
    assert execution.logs.stderr == ["to err\n"]
    assert out == ["to out\n"]

    failed = sbx.run_code("1 / 0")
    assert failed.error is not None
    assert failed.error.name == "ZeroDivisionError"
    assert "division by zero" in failed.error.value


def test_matplotlib_figure_comes_back_as_png(sbx: Sandbox) -> None:
    """A figure the cell leaves open is a PNG result (base64), as E2B's server sends it."""
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.title('t')"
    )
    assert execution.error is None
    pngs = [r.png for r in execution.results if r.png]
    assert pngs
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)


def test_contexts_create_list_restart_remove(sbx: Sandbox) -> None:
    """Contexts are separate interpreters; restart forgets variables; remove deletes."""
    ctx = sbx.create_code_context(cwd="/home/user")
    assert ctx.cwd == "/home/user"
    sbx.run_code("y = 'in ctx'", context=ctx)
    assert sbx.run_code("y", context=ctx).text == "in ctx"  # E2B's text: no quotes
    assert sbx.run_code("'y' in dir()").text == "False"  # the default context
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}

    sbx.restart_code_context(ctx)
    assert sbx.run_code("y", context=ctx).error is not None
    sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
    with pytest.raises(SandboxException):
        sbx.run_code("1", language="ruby")


def test_an_unknown_context_is_not_found_on_every_call(sbx: Sandbox, e2b_serve: E2bServe) -> None:
    """As E2B's interpreter answers: a context id that names no context (never made,
    removed, malformed, ``.`` or ``..``) is 404, the SDK's ``NotFoundException``, on
    ``run_code``, ``restart_code_context`` and ``remove_code_context`` alike."""
    removed = sbx.create_code_context()
    sbx.remove_code_context(removed)
    for context_id in ("never-made", removed.id, "bad id", "x" * 65, "-x", ".hidden"):
        context = Context(context_id=context_id, language="python", cwd="/home/user")
        with pytest.raises(NotFoundException):
            sbx.run_code("1", context=context)
        with pytest.raises(NotFoundException):
            sbx.restart_code_context(context_id)
        with pytest.raises(NotFoundException):
            sbx.remove_code_context(context_id)
    # "." and "..": the SDK's client would normalize them out of a path, another
    # client percent-encodes them (and the server decodes them).
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49999",
        "E2B-Traffic-Access-Token": sbx.traffic_access_token or "",
    }
    with httpx.Client(base_url=f"{e2b_serve.url}/e2b/sandbox", headers=headers) as client:
        for dots in (".", ".."):
            segment = dots.replace(".", "%2E")
            answers = [
                client.post("/execute", json={"code": "1", "context_id": dots}),
                client.post(f"/contexts/{segment}/restart"),
                client.delete(f"/contexts/{segment}"),
            ]
            for answer in answers:
                assert answer.status_code == 404, (dots, answer.request.url, answer.text)
                assert answer.json()["error_code"] == "not_found"
    assert sbx.run_code("6 * 7").text == "42"


def test_files_written_by_code_are_files_of_the_sandbox(sbx: Sandbox) -> None:
    """The interpreter works in the session workspace, the same ``/home/user`` files see."""
    sbx.run_code("open('from_code.txt', 'w').write('written by a cell')")
    assert sbx.files.read("/home/user/from_code.txt") == "written by a cell"
    sbx.files.write("/home/user/for_code.txt", "read by a cell")
    assert sbx.run_code("open('/home/user/for_code.txt').read()").text == "read by a cell"


async def test_async_run_code(e2b_serve: E2bServe) -> None:
    """The async SDK: state across cells, and a result."""
    sandbox = await AsyncSandbox.create(**e2b_serve.opts())
    try:
        await sandbox.run_code("x = 1")
        execution = await sandbox.run_code("x + 41")
        assert execution.text == "42"
    finally:
        await sandbox.kill()
