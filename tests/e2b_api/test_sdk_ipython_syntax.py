"""``e2b-code-interpreter``'s ``run_code`` with IPython's cell syntax, as E2B's kernel takes it.

LLM-written notebook code uses ``!cmd``, ``%magic`` and ``%%magic`` lines; E2B's
interpreter is an IPython kernel, so they work there, and here through IPython's
own shell (Debian's ``python3-ipython``, installed by scripts/test).
"""

from __future__ import annotations

import base64

from e2b_code_interpreter import Sandbox

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_shell_commands_print_and_capture(sbx: Sandbox) -> None:
    out: list[str] = []
    shown = sbx.run_code("!echo hi", on_stdout=lambda message: out.append(message.line))
    assert shown.error is None
    assert shown.logs.stdout == ["hi\n"]
    assert out == ["hi\n"]
    captured = sbx.run_code("x = !echo hi\nx")
    assert captured.error is None
    assert captured.text == "['hi']"
    assert sbx.run_code("x[0]").text == "hi"


def test_time_writefile_and_cd(sbx: Sandbox) -> None:
    timed = sbx.run_code("%time y = 6 * 7")
    assert timed.error is None
    assert any("Wall time" in line for line in timed.logs.stdout)
    assert sbx.run_code("y").text == "42"

    written = sbx.run_code("%%writefile /home/user/hello.py\nprint('hello from a file')\n")
    assert written.error is None
    assert sbx.files.read("/home/user/hello.py") == "print('hello from a file')\n"
    assert sbx.run_code("!python3 /home/user/hello.py").logs.stdout == ["hello from a file\n"]

    sbx.files.make_dir("/home/user/proj")
    context = sbx.create_code_context()
    assert sbx.run_code("%cd /home/user/proj", context=context).error is None
    # Later cells of that context run there; the default context stays where it was.
    sbx.run_code("open('made.txt', 'w').write('x')", context=context)
    assert sbx.files.exists("/home/user/proj/made.txt")
    same = "import os; os.path.samefile(os.getcwd(), '/home/user/proj')"
    assert sbx.run_code(same, context=context).text == "True"
    assert sbx.run_code(same).text == "False"
    sbx.remove_code_context(context)


def test_matplotlib_inline_keeps_figures_coming_back(sbx: Sandbox) -> None:
    assert sbx.run_code("%matplotlib inline").error is None
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()"
    )
    assert execution.error is None
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)


def test_a_syntax_error_names_the_cell_not_the_driver(sbx: Sandbox) -> None:
    execution = sbx.run_code("print('never')\nif True print(1)")
    assert execution.error is not None
    assert execution.error.name == "SyntaxError"
    assert execution.logs.stdout == []
    traceback = execution.error.traceback
    assert "line 2" in traceback
    assert "if True print(1)" in traceback
    for driver_part in ("ast.py", "sandcell", "kernel.py", "Traceback (most recent call last)"):
        assert driver_part not in traceback


def test_plain_python_is_unchanged(sbx: Sandbox) -> None:
    assert sbx.run_code("10 % 4").text == "2"
    assert sbx.run_code("a = 3\na != 3").text == "False"
    failed = sbx.run_code("1 / 0")
    assert failed.error is not None
    assert failed.error.name == "ZeroDivisionError"
