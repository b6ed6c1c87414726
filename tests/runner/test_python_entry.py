"""A Python job runs its entry file as ``__main__``, as ``python main.py`` would, with the
workspace first on ``sys.path`` as ``python -c`` would put the working directory."""

from __future__ import annotations

import os

from sandcell_runner.languages import JOB_DIR, discover_languages, has_safe_path
from tests.fixtures.runner_process import RunnerProcess
from tests.runner.helpers import b64, execute

ENTRY = f"{JOB_DIR}/main.py"


def test_what_the_script_defines_is_the_main_module(runner: RunnerProcess) -> None:
    """pickle (and multiprocessing, and anything else that looks a class up by its
    module) finds a class the script defines in ``sys.modules['__main__']``: a
    bootstrap that ``exec``s the file into a dict of its own left that module empty."""
    code = (
        "import pickle, sys\n"
        "class Point:\n"
        "    def __init__(self, x): self.x = x\n"
        "print(pickle.loads(pickle.dumps(Point(3))).x, sys.modules['__main__'].Point is Point)\n"
    )
    result = execute(runner, language="python", code=code)
    assert result["status"] == "ok", result["stderr"]
    assert result["stdout"] == "3 True\n"


def test_the_workspace_comes_first_and_the_callers_path_after(runner: RunnerProcess) -> None:
    code = (
        "import sys, helper\n"
        "print(helper.WHO, sys.argv[0], __file__, __name__)\n"
        "print([p for p in sys.path if p.startswith(('/mnt', '/opt'))])\n"
    )
    result = execute(
        runner,
        language="python",
        code=code,
        env={"PYTHONPATH": "/opt/extra"},
        inline_files=[{"name": "helper.py", "content_b64": b64("WHO = 'workspace'\n")}],
    )
    assert result["status"] == "ok", result["stderr"]
    first, second = result["stdout"].splitlines()
    assert first == f"workspace {ENTRY} {ENTRY} __main__"
    # Nothing of the read-only job directory: the entry file's own directory stays off.
    paths = eval(second)
    assert paths[-1] == "/opt/extra"
    assert len(paths) == 2
    assert not any(p.startswith(JOB_DIR) for p in paths)


def test_an_uncaught_error_names_the_entry_file_and_exits_1(runner: RunnerProcess) -> None:
    result = execute(runner, language="python", code="x = 1\n\nraise ValueError('boom')\n")
    assert result["exit_code"] == 1
    assert result["status"] == "error"
    assert result["stderr"] == (
        "Traceback (most recent call last):\n"
        f'  File "{ENTRY}", line 3, in <module>\n'
        "    raise ValueError('boom')\n"
        "ValueError: boom\n"
    )


def test_an_interpreter_is_asked_for_minus_p_by_its_version() -> None:
    """``-P`` came with 3.11: an older or unnamed interpreter keeps the bootstrap."""
    python = discover_languages(jailed=True)["python"]
    assert python.safe_path == has_safe_path(python.binary)
    assert has_safe_path("/usr/bin/python3") == (
        os.path.basename(os.path.realpath("/usr/bin/python3")) >= "python3.11"
    )
    assert python.argv(["a"]) == [python.binary, "-u", "-P", ENTRY, "a"]
    assert python.env("/w", {}) == {"PYTHONPATH": "/w"}
    assert python.env("/w", {"PYTHONPATH": "/x:/y"}) == {"PYTHONPATH": "/w:/x:/y"}
    for name in ("python3.10", "python3", "python2.7", "pypy"):
        assert not has_safe_path(f"/nonexistent/{name}")
    assert has_safe_path("/nonexistent/python3.12")
    assert has_safe_path("/nonexistent/python3.13")
