"""IPython's cell syntax in a Python context, as E2B's kernel takes it (Debian's IPython).

``!cmd``, ``x = !cmd``, line and cell magics run through IPython's own shell in the
context's jail; plain cells are unchanged; a SyntaxError shows the cell, not the
driver.
"""

from __future__ import annotations

from tests.runner.contexts.helpers import (
    PLOT_CELL,
    ContextClient,
    interrupt_while_running,
    png_size,
)


def test_shell_escapes_run_in_the_jail_and_capture_a_list(client: ContextClient, ctx: str) -> None:
    client.run(ctx, "name = 'sandcell'")
    shown = client.stream(ctx, "print('before')\n!echo hi $name\nprint('after')")
    assert [(e["type"], e.get("data")) for e in shown[:-1]] == [
        ("stdout", "before\n"),
        ("stdout", "hi sandcell\n"),
        ("stdout", "after\n"),
    ]
    assert shown[-1]["status"] == "ok"
    assert client.main_text(ctx, "lines = !printf 'a\\nb\\n'\nlines") == "['a', 'b']"
    # The command is a child of the jailed interpreter: the jail's own pid namespace.
    assert client.main_text(ctx, "pids = !echo $$PPID\npids") == "['1']"
    assert client.main_text(ctx, "!exit 3\n_exit_code") == "3"


def test_an_interrupt_stops_a_shell_command_and_keeps_the_context(
    client: ContextClient, ctx: str
) -> None:
    client.run(ctx, "n = 7")
    answer = interrupt_while_running(client, ctx, "!sleep 600", settle_s=0.5)  # into the command
    assert answer["status"] == "error"
    assert answer["error"]["name"] == "KeyboardInterrupt"
    assert answer["context_lost"] is False
    assert client.main_text(ctx, "n") == "7"


def test_line_and_cell_magics(client: ContextClient, ctx: str) -> None:
    timed = client.run(ctx, "%time total = sum(range(10))")
    assert timed["status"] == "ok", timed
    assert "Wall time" in timed["stdout"]
    assert client.main_text(ctx, "total") == "45"
    assert client.main_text(ctx, "%time 6 * 7") == "42"

    written = client.run(ctx, "%%writefile made.py\nVALUE = 'from a file'\n")
    assert written["status"] == "ok", written
    assert written["stdout"] == "Writing made.py\n"
    assert client.main_text(ctx, "import made\nmade.VALUE") == "'from a file'"

    client.run(ctx, "import os\nos.makedirs('sub/dir', exist_ok=True)")
    moved = client.run(ctx, "%cd sub/dir")
    assert moved["status"] == "ok", moved
    assert moved["stdout"].rstrip().endswith("/sub/dir")
    # The next cells run there.
    assert client.main_text(ctx, "os.getcwd().endswith('/sub/dir')") == "True"
    client.run(ctx, "open('here.txt', 'w').write('x')")
    assert client.main_text(ctx, "%cd -q ../..\nos.path.exists('sub/dir/here.txt')") == "True"


def test_matplotlib_inline_is_accepted_and_figures_come_back(
    client: ContextClient, ctx: str
) -> None:
    inline = client.run(ctx, "%matplotlib inline", timeout_ms=120_000)
    assert inline["status"] == "ok", inline
    assert inline["results"] == []
    result = client.run(ctx, PLOT_CELL, timeout_ms=120_000)
    assert result["status"] == "ok", result
    images = [r for r in result["results"] if "image/png" in r["data"]]
    assert len(images) == 1, result
    assert images[0]["is_main_result"] is False
    width, height = png_size(images[0]["data"]["image/png"])
    # The inline backend's own rendering (a tight box around the figure's 200x150).
    assert 100 < width < 300
    assert 75 < height < 225
    # A figure left open at the end of the cell comes back too, once.
    left = client.run(ctx, "plt.plot([3, 2, 1]);", timeout_ms=120_000)
    assert len([r for r in left["results"] if "image/png" in r["data"]]) == 1, left
    assert client.run(ctx, "1 + 1")["results"][0]["data"] == {"text/plain": "2"}


def test_errors_in_magics_are_the_cells_errors(client: ContextClient, ctx: str) -> None:
    failed = client.run(ctx, "%time 1 / 0")
    assert failed["status"] == "error"
    assert failed["error"]["name"] == "ZeroDivisionError"
    unknown = client.run(ctx, "%no_such_magic")
    assert unknown["error"]["name"] == "UsageError"
    for error in (failed["error"], unknown["error"]):
        assert "IPython/core" not in error["traceback"]
        assert "sandcell" not in error["traceback"]


def test_a_syntax_error_shows_the_cell_and_no_driver_frame(client: ContextClient, ctx: str) -> None:
    syntax = client.run(ctx, "x = 1\ndef (")
    assert syntax["status"] == "error"
    error = syntax["error"]
    assert error["name"] == "SyntaxError"
    assert error["traceback"].startswith('  File "<cell-1>", line 2\n    def (\n')
    assert error["traceback"].endswith("SyntaxError: invalid syntax\n")
    assert "ast.py" not in error["traceback"]
    assert "Traceback (most recent call last)" not in error["traceback"]
    # Nothing of the cell ran.
    assert client.run(ctx, "x")["error"]["name"] == "NameError"


def test_plain_cells_are_untouched_by_ipython(client: ContextClient, ctx: str) -> None:
    # Valid Python never goes through IPython: modulo and a '!=' stay Python, and
    # IPython's names appear only once a cell needed it.
    assert client.main_text(ctx, "7 % 3") == "1"
    assert client.main_text(ctx, "x = 5\nx != 4") == "True"
    assert client.main_text(ctx, "'get_ipython' in dir() or 'In' in dir()") == "False"
    client.run(ctx, "In = 'mine'")
    client.run(ctx, "!true")
    assert client.main_text(ctx, "In") == "'mine'"
    assert client.main_text(ctx, "get_ipython().__class__.__name__") == "'SandcellShell'"
