"""Stateful code contexts on a real runner over HTTP: state, display, errors, limits."""

from __future__ import annotations

import json
import time

import psutil

from tests.golden import load_golden
from tests.runner.contexts.helpers import (
    NDJSON,
    PLOT_CELL,
    ContextClient,
    interrupt_while_running,
    png_size,
)

GOLDEN = load_golden()


def test_languages_say_which_have_contexts(client: ContextClient) -> None:
    languages = {
        item["name"]: item for item in client.http.get("/v1/languages").json()["languages"]
    }
    assert languages["python"]["contexts"] is True
    assert languages["bash"]["contexts"] is False


def test_variables_persist_and_the_last_expression_is_the_main_result(
    client: ContextClient, ctx: str
) -> None:
    first = client.run(ctx, "x = 41")
    assert first == {**first, "status": "ok", "results": [], "execution_count": 1}
    second = client.run(ctx, "x + 1")
    assert second["results"] == [
        {"type": "result", "data": {"text/plain": "42"}, "is_main_result": True}
    ]
    assert second["execution_count"] == 2
    # A statement as the last line displays nothing.
    assert client.run(ctx, "y = x * 2")["results"] == []
    assert client.main_text(ctx, "y") == "82"
    listed = client.http.get("/v1/session/contexts").json()["contexts"]
    mine = [c for c in listed if c["context_id"] == ctx]
    assert mine == [
        {
            "context_id": ctx,
            "language": "python",
            "state": "idle",
            "cwd": "",
            "execution_count": 4,
            "lost_reason": None,
        }
    ]


def test_stream_sends_output_and_results_in_order(client: ContextClient, ctx: str) -> None:
    events = client.stream(
        ctx,
        "import sys, subprocess\nprint('one')\nsubprocess.run(['echo', 'two'])\n"
        "print('oops', file=sys.stderr)\ndisplay(3)\nprint('four')\n5",
    )
    kinds = [(e["type"], e.get("data")) for e in events]
    assert kinds[-1][0] == "end"
    assert kinds[:-1] == [
        ("stdout", "one\n"),
        ("stdout", "two\n"),
        ("stderr", "oops\n"),
        ("result", {"text/plain": "3"}),
        ("stdout", "four\n"),
        ("result", {"text/plain": "5"}),
    ]
    assert [e.get("is_main_result") for e in events if e["type"] == "result"] == [False, True]
    end = events[-1]
    assert end["status"] == "ok"
    assert end["context_lost"] is False
    assert end["wall_ms"] >= 0
    assert end["cpu_ms"] >= 0
    # The same run answered as one object carries the same content.
    gathered = client.run(ctx, "print('one')\n5")
    assert gathered["stdout"] == "one\n"
    assert [r["data"] for r in gathered["results"]] == [{"text/plain": "5"}]


def test_an_exception_gives_a_traceback_and_keeps_the_variables(
    client: ContextClient, ctx: str
) -> None:
    client.run(ctx, "kept = 'still here'")
    result = client.run(ctx, "def boom():\n    return 1 / 0\n\nboom()")
    assert result["status"] == "error"
    error = result["error"]
    assert error["name"] == "ZeroDivisionError"
    assert error["value"] == "division by zero"
    assert 'File "<cell-2>", line 2, in boom' in error["traceback"]
    assert "return 1 / 0" in error["traceback"]
    assert "driver" not in error["traceback"]
    syntax = client.run(ctx, "def (")
    assert syntax["error"]["name"] == "SyntaxError"
    assert client.main_text(ctx, "kept") == "'still here'"


def test_interrupt_stops_a_busy_loop_and_keeps_the_variables(
    client: ContextClient, ctx: str
) -> None:
    client.run(ctx, "n = 7")
    answer = interrupt_while_running(client, ctx, "while True:\n    pass", settle_s=0.2)
    assert answer["status"] == "error"
    assert answer["error"]["name"] == "KeyboardInterrupt"
    assert answer["context_lost"] is False
    assert client.main_text(ctx, "n") == "7"


def test_timeout_interrupts_and_keeps_the_context(client: ContextClient, ctx: str) -> None:
    client.run(ctx, "v = 'alive'")
    result = client.run(ctx, "import time\nwhile True:\n    time.sleep(0.01)", timeout_ms=800)
    assert result["status"] == "timeout"
    assert result["context_lost"] is False
    assert result["error"]["name"] == "KeyboardInterrupt"
    assert client.main_text(ctx, "v") == "'alive'"


def test_a_cell_that_ignores_sigint_is_killed_and_the_context_lost(
    client: ContextClient, ctx: str
) -> None:
    client.run(ctx, "v = 1")
    code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"
    result = client.run(ctx, code, timeout_ms=800)
    assert result["status"] == "timeout"
    assert result["context_lost"] is True
    again = client.run_raw(ctx, "v")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "context_lost"
    info = [
        c
        for c in client.http.get("/v1/session/contexts").json()["contexts"]
        if c["context_id"] == ctx
    ]
    assert info[0]["state"] == "lost"
    # Restart gives a fresh namespace under the same id.
    restarted = client.http.post(f"/v1/session/contexts/{ctx}/restart")
    assert restarted.status_code == 200, restarted.text
    assert restarted.json()["state"] == "idle"
    assert client.run(ctx, "v")["error"]["name"] == "NameError"


def test_memory_bomb_is_memory_limit_then_context_lost(client: ContextClient, ctx: str) -> None:
    result = client.run(ctx, "hog = []\nwhile True:\n    hog.append(bytearray(64 * 1024 * 1024))")
    assert result["status"] == "memory_limit"
    assert result["context_lost"] is True
    again = client.run_raw(ctx, "1")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "context_lost"
    assert "memory" in again.json()["error"]["message"]


def test_fork_bomb_is_contained(client: ContextClient) -> None:
    """The pids limit stops it; the timeout ends it and every copy it made."""
    bomb = client.create()
    uid = int(client.main_text(bomb, "import os\nos.getuid()"))
    before = {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid}
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = client.run(bomb, code, timeout_ms=2000)
    assert result["status"] == "timeout"
    deadline = time.monotonic() + 10
    left = {-1}
    while left and time.monotonic() < deadline:
        now = {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid}
        left = now - before
        time.sleep(0.1)
    assert not left
    client.http.delete(f"/v1/session/contexts/{bomb}")
    # The runner and the other contexts carry on.
    other = client.create()
    assert client.main_text(other, "sum(range(10))") == "45"
    client.http.delete(f"/v1/session/contexts/{other}")


def test_two_contexts_do_not_share_variables(client: ContextClient) -> None:
    first, second = client.create(), client.create()
    client.run(first, "secret = 'first'")
    assert client.run(second, "secret")["error"]["name"] == "NameError"
    # They do share the session's workspace, like two notebooks in one folder.
    client.run(first, "open('shared.txt', 'w').write('from first')")
    assert client.main_text(second, "open('shared.txt').read()") == "'from first'"
    for context_id in (first, second):
        assert client.http.delete(f"/v1/session/contexts/{context_id}").status_code == 204


def test_matplotlib_figure_comes_back_as_png(client: ContextClient, ctx: str) -> None:
    result = client.run(ctx, PLOT_CELL, timeout_ms=120_000)
    assert result["status"] == "ok", result
    images = [r for r in result["results"] if "image/png" in r["data"]]
    assert len(images) == 1, result
    assert png_size(images[0]["data"]["image/png"]) == (200, 150)
    assert images[0]["data"]["text/plain"] == "<Figure size 200x150 with 1 Axes>"
    assert images[0]["is_main_result"] is False
    # Figures are closed once shown: the next cell shows nothing of them.
    assert client.run(ctx, "1 + 1")["results"][0]["data"] == {"text/plain": "2"}


def test_dataframe_comes_back_as_html_and_text(client: ContextClient, ctx: str) -> None:
    result = client.run(
        ctx, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})", timeout_ms=120_000
    )
    assert result["status"] == "ok", result
    data = result["results"][0]["data"]
    assert "<table" in data["text/html"]
    assert "<th>b</th>" in data["text/html"]
    assert data["text/plain"].split() == ["a", "b", "0", "1", "x", "1", "2", "y"]


def test_rich_reprs_and_display(client: ContextClient, ctx: str) -> None:
    code = (
        "class Rich:\n"
        "    def _repr_html_(self): return '<b>rich</b>'\n"
        "    def _repr_markdown_(self): return '**rich**'\n"
        "    def _repr_png_(self): return b'\\x89PNG-bytes'\n"
        "    def _repr_json_(self): return {'k': [1, 2]}\n"
        "    def _repr_latex_(self): return None\n"
        "    def __repr__(self): return 'Rich()'\n"
        "display(Rich())\n"
        "Rich()"
    )
    result = client.run(ctx, code)
    shown, main = result["results"]
    assert shown["is_main_result"] is False
    assert main["is_main_result"] is True
    assert main["data"] == {
        "text/html": "<b>rich</b>",
        "text/markdown": "**rich**",
        "image/png": "iVBORy1ieXRlcw==",
        "application/json": {"k": [1, 2]},
        "text/plain": "Rich()",
    }
    broken = client.run(ctx, "class Broken:\n    def _repr_html_(self): raise ValueError\nBroken()")
    assert broken["status"] == "ok"
    assert set(broken["results"][0]["data"]) == {"text/plain"}


def test_the_interpreter_has_no_token_and_no_network(client: ContextClient, ctx: str) -> None:
    token = client.runner.token
    code = (
        "import os, glob, socket\n"
        "seen = repr(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n"
        "        seen += open(path, 'rb').read().decode('latin-1')\n"
        "    except OSError:\n"
        "        pass\n"
        "reached = []\n"
        f"for address in [('127.0.0.1', {client.runner.port}), ('1.1.1.1', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(address, timeout=2).close()\n"
        "        reached.append(address)\n"
        "    except OSError:\n"
        "        pass\n"
        "(os.getuid(), os.getcwd(), reached, seen)"
    )
    text = client.main_text(ctx, code)
    assert token not in text
    assert ", '/mnt/data', [], " in text
    assert not text.startswith("(0,")


def test_bad_requests_get_machine_readable_codes(client: ContextClient, ctx: str) -> None:
    http = client.http
    wrong = http.post("/v1/session/contexts", json={"language": "cobol"})
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (400, "unsupported_language")
    unknown = http.post("/v1/session/contexts", json={"language": "python", "tone": "x"})
    assert unknown.status_code == 400
    missing = client.run_raw("nope", "1")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    assert http.post("/v1/session/contexts/bad%20id/run", json={"code": "1"}).status_code == 400
    for dots in (".", "..", ".hidden"):
        # Percent-encoded, or the client would normalize them away; the server decodes them.
        segment = dots.replace(".", "%2E")
        for method, path in (("POST", f"/{segment}/run"), ("DELETE", f"/{segment}")):
            refused = http.request(method, f"/v1/session/contexts{path}", json={"code": "1"})
            assert (refused.status_code, refused.json()["error"]["code"]) == (400, "bad_request")
        named = http.post("/v1/session/contexts", json={"language": "python", "context_id": dots})
        assert (named.status_code, named.json()["error"]["code"]) == (400, "bad_request")
    escape = http.post("/v1/session/contexts", json={"language": "python", "cwd": "../x"})
    assert escape.json()["error"]["code"] == "invalid_path"
    taken = http.post("/v1/session/contexts", json={"language": "python", "context_id": ctx})
    assert (taken.status_code, taken.json()["error"]["code"]) == (409, "session_conflict")
    with client.runner.client() as plain:
        headerless = plain.post("/v1/session/contexts", json={})
    assert headerless.status_code == 400
    assert http.delete("/v1/session/contexts/nope").status_code == 404


def test_named_context_with_cwd_and_env(client: ContextClient) -> None:
    client.http.put("/v1/session/files/sub/data.txt", content=b"in sub")
    response = client.http.post(
        "/v1/session/contexts",
        json={"language": "python", "context_id": "analysis", "cwd": "sub", "env": {"MODE": "a"}},
    )
    assert response.status_code == 201, response.text
    assert response.json()["cwd"] == "sub"
    text = client.main_text("analysis", "import os\n(open('data.txt').read(), os.environ['MODE'])")
    assert text == "('in sub', 'a')"
    per_run = client.run("analysis", "import os\nos.environ.get('RUN')", env={"RUN": "only"})
    assert per_run["results"][0]["data"]["text/plain"] == "'only'"
    assert client.run("analysis", "os.environ.get('RUN')")["results"] == []
    client.http.delete("/v1/session/contexts/analysis")


def test_a_run_reports_the_files_it_wrote(client: ContextClient, ctx: str) -> None:
    wrote = client.run(ctx, "open('report.csv', 'w').write('a,b\\n1,2\\n')")
    assert wrote["workspace_changed"] is True
    assert [(f["name"], f["size"], f["content_b64"]) for f in wrote["files"]] == [
        ("report.csv", 8, "YSxiCjEsMgo=")
    ]
    # Unchanged since: nothing to report, nothing to checkpoint.
    same = client.run(ctx, "open('report.csv').read()")
    assert (same["files"], same["workspace_changed"]) == ([], False)
    removed = client.run(ctx, "import os\nos.remove('report.csv')")
    assert (removed["files"], removed["workspace_changed"]) == ([], True)


def test_a_real_run_matches_the_golden_wire(client: ContextClient) -> None:
    """The shared golden events are what a runner really sends (timings aside)."""
    vector = GOLDEN["context_run"]
    context_id = client.create()
    events = client.stream(context_id, vector["code"])
    golden = [json.loads(line) for line in vector["events"]]
    timing = ("wall_ms", "cpu_ms")
    assert [{k: v for k, v in e.items() if k not in timing} for e in events] == [
        {k: v for k, v in e.items() if k not in timing} for e in golden
    ]
    client.http.delete(f"/v1/session/contexts/{context_id}")


def test_a_node_context_keeps_its_bindings(client: ContextClient) -> None:
    """JavaScript through node's vm: bindings persist, the completion value is the main
    result, console output comes first, errors and timeouts keep the context."""
    node = client.create(language="node")
    assert client.run(node, "var x = 41; let y = 'kept'")["status"] == "ok"
    events = client.stream(node, "console.log('hi', {a: 1}); console.error('warn'); x + 1")
    assert [(e["type"], e.get("data")) for e in events[:-1]] == [
        ("stdout", "hi { a: 1 }\n"),
        ("stderr", "warn\n"),
        ("result", {"text/plain": "42"}),
    ]
    failed = client.run(node, "function f() { throw new TypeError('bad') }\nf()")
    assert failed["error"]["name"] == "TypeError"
    assert "at f (<cell-3>:1:" in failed["error"]["traceback"]
    assert "driver" not in failed["error"]["traceback"]
    stuck = client.run(node, "while (true) {}", timeout_ms=800)
    assert (stuck["status"], stuck["context_lost"]) == ("timeout", False)
    assert client.main_text(node, "y") == "'kept'"
    client.http.delete(f"/v1/session/contexts/{node}")


def test_output_past_the_cap_interrupts_the_cell_and_keeps_the_context(
    client: ContextClient, ctx: str
) -> None:
    """The runner's stdout cap (1 MiB here) ends a cell that prints forever: output_limit."""
    client.run(ctx, "n = 5")
    flood = client.run(ctx, "while True:\n    print('y' * 1000)", timeout_ms=60_000)
    assert flood["status"] == "output_limit"
    assert flood["context_lost"] is False
    assert len(flood["stdout"].encode()) <= 1024 * 1024
    assert client.main_text(ctx, "n") == "5"


def test_a_bad_env_is_refused_before_a_streamed_run_begins(client: ContextClient, ctx: str) -> None:
    """A run's bad ``env`` is a 400 ``bad_request``, streamed or not: it was refused only
    after the stream's 200 began, which callers read as a broken sandbox (a 503)."""
    for env in ({"A B": "x"}, {"OK": "nul\x00"}):
        with client.http.stream(
            "POST",
            f"/v1/session/contexts/{ctx}/run",
            json={"code": "1", "env": env},
            headers={"Accept": NDJSON},
        ) as response:
            response.read()
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "bad_request", response.text
    assert client.main_text(ctx, "1 + 1") == "2"
