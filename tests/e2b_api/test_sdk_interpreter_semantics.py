"""What an E2B user expects of ``run_code``, checked through ``e2b-code-interpreter``.

Each behaviour is E2B's code-interpreter server's (``template/server`` in
e2b-dev/code-interpreter): a ``str`` result's ``text`` without its quotes, figures
as PNG display results after the cell's main result, callbacks in the cell's own
order, ``ExecutionError`` with the traceback, a cell whose client gave up
interrupted (the context answers the next call, variables kept), its languages by
E2B's names (``javascript``/``js`` served by a node context; the others a clear
400), and contexts with their own cwd and variables.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator

import pytest
from e2b.exceptions import SandboxException, TimeoutException
from e2b_code_interpreter import OutputMessage, Result, Sandbox
from e2b_code_interpreter.models import ExecutionError

from tests.e2b_api.conftest import E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_text_is_e2bs_a_str_without_its_quotes(sbx: Sandbox) -> None:
    """E2B's server strips the quotes of a ``repr`` in quotes (``Result.text``)."""
    assert sbx.run_code("'abc'").text == "abc"
    assert sbx.run_code("'it' + \"'s\"").text == "it's"  # repr: "it's"
    assert sbx.run_code("42").text == "42"
    assert sbx.run_code("[1, 'a']").text == "[1, 'a']"


def test_each_figure_is_a_png_result_after_the_main_one(sbx: Sandbox) -> None:
    """Two figures the cell leaves open: two display results (not main), each a PNG
    (base64) with its text, after the last expression's main result."""
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.figure(); plt.plot([1, 2], [3, 4]); plt.title('a')\n"
        "plt.figure(); plt.bar(['x', 'y'], [1, 2]); plt.title('b')\n"
        "'done'"
    )
    assert execution.error is None
    assert [r.is_main_result for r in execution.results] == [True, False, False]
    assert execution.text == "done"
    for figure in execution.results[1:]:
        assert list(figure.formats()) == ["text", "png"]
        assert base64.b64decode(figure.png or "").startswith(PNG_MAGIC)
    assert execution.results[1].png != execution.results[2].png
    shown = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")
    assert [r.is_main_result for r in shown.results] == [False]
    assert shown.results[0].png


def test_callbacks_come_in_the_cells_order(sbx: Sandbox) -> None:
    seen: list[tuple[str, str]] = []

    def record(kind: str) -> Callable[[OutputMessage | Result | ExecutionError], None]:
        def on(item: OutputMessage | Result | ExecutionError) -> None:
            text = item.line if isinstance(item, OutputMessage) else str(item)
            seen.append((kind, text))

        return on

    execution = sbx.run_code(
        "import sys\nprint('o1', flush=True)\nprint('e1', file=sys.stderr, flush=True)\n"
        "display('d1')\nprint('o2', flush=True)\n42",
        on_stdout=record("out"),
        on_stderr=record("err"),
        on_result=record("result"),
    )
    assert seen == [
        ("out", "o1\n"),
        ("err", "e1\n"),
        ("result", "Result(d1)"),
        ("out", "o2\n"),
        ("result", "Result(42)"),
    ]
    assert execution.logs.stdout == ["o1\n", "o2\n"]
    assert [r.is_main_result for r in execution.results] == [False, True]


def test_an_exception_is_an_execution_error_with_its_traceback(sbx: Sandbox) -> None:
    errors: list[ExecutionError] = []
    execution = sbx.run_code(
        "def inner():\n    raise ValueError('bad value')\nprint('before')\ninner()",
        on_error=errors.append,
    )
    assert execution.logs.stdout == ["before\n"]
    assert execution.error is not None
    assert (execution.error.name, execution.error.value) == ("ValueError", "bad value")
    assert "in inner" in execution.error.traceback
    assert execution.error.traceback.rstrip().endswith("ValueError: bad value")
    assert errors == [execution.error]
    syntax = sbx.run_code("def (").error
    assert syntax is not None
    assert syntax.name == "SyntaxError"
    # The context lives on.
    assert sbx.run_code("1 + 1").text == "2"


def test_a_cell_whose_client_timed_out_is_interrupted(sbx: Sandbox) -> None:
    """As E2B's server interrupts its kernel when the client goes: the SDK's timeout
    raises, the cell stops (its last line never runs), and the context answers the
    next call at once with its variables, not as busy with the abandoned cell."""
    sbx.run_code("kept = 'before'; finished = False")
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(600)\nfinished = True", timeout=1)
    assert sbx.run_code("kept").text == "before"
    assert sbx.run_code("finished").text == "False"


def test_javascript_by_e2bs_names_and_the_rest_refused_by_name(sbx: Sandbox) -> None:
    """``javascript`` and ``js`` run in a node context (listed as ``javascript``);
    E2B's other languages are a 400 that names what is served, for a cell and a
    context alike, never a hang or a 500."""
    assert sbx.run_code("1 + 1", language="javascript").text == "2"
    assert sbx.run_code("[1, 2].length", language="js").text == "2"
    context = sbx.create_code_context(language="javascript")
    assert context.language == "javascript"
    sbx.run_code("var kept = 7", context=context)
    assert sbx.run_code("kept * 6", context=context).text == "42"
    assert "javascript" in {c.language for c in sbx.list_code_contexts()}
    for language in ("typescript", "ts", "r", "java", "bash"):
        with pytest.raises(SandboxException, match=r"400.*is not served.*python, javascript"):
            sbx.run_code("1", language=language)
        with pytest.raises(SandboxException, match=r"400.*is not served"):
            sbx.create_code_context(language=language)


def test_a_context_has_its_own_cwd_and_variables(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/work")
    context = sbx.create_code_context(cwd="/home/user/work")
    assert context.cwd == "/home/user/work"
    # The jail's own path of the workspace may differ (``/mnt/data``); it is that dir.
    same = "import os; os.path.samefile(os.getcwd(), '/home/user/work')"
    assert sbx.run_code(same, context=context).text == "True"
    sbx.run_code("open('here.txt', 'w').write('x')", context=context)
    assert sbx.files.exists("/home/user/work/here.txt")
    other = sbx.create_code_context()
    sbx.run_code("only_here = 1", context=context)
    assert sbx.run_code("'only_here' in dir()", context=other).text == "False"
    with pytest.raises(SandboxException, match=r"400.*only /home/user"):
        sbx.create_code_context(cwd="/etc")
    # A missing directory is named as the caller gave it.
    with pytest.raises(SandboxException, match=r"400.*'/home/user/missing' is not a directory"):
        sbx.create_code_context(cwd="/home/user/missing")
    sbx.remove_code_context(context)
    sbx.remove_code_context(other)


@pytest.fixture(scope="module")
def short_jobs() -> Iterator[E2bServe]:
    """A service whose runners give a sandcell job 1 s unless it asks for more."""
    with traversable_dir("e2b-cells-") as base:
        service = start_serve(base, env={"SANDCELL_RUNNER_TIMEOUT_MS": "1000"})
        try:
            yield service
        finally:
            stop_serve(service)
            assert not stop_leftovers(service.runtime_dir)


def test_a_cell_runs_past_the_runners_job_default(short_jobs: E2bServe) -> None:
    """E2B's server sets a cell no limit of its own: a cell longer than the runner's
    default for a job (1 s here) ends as written, within the SDK's ``timeout``."""
    sandbox = Sandbox.create(**short_jobs.opts())
    try:
        execution = sandbox.run_code("import time\ntime.sleep(3)\n'slept'", timeout=120)
        assert execution.error is None
        assert execution.text == "slept"
    finally:
        sandbox.kill()
