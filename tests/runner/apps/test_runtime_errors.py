"""Runtime errors from process output and the browser: deduplicated, counted, categorised."""

from __future__ import annotations

import time

from tests.runner.apps.helpers import APP_SERVER, AppClient

NODE_SERVER = r"""
const http = require("http");
http.createServer((req, res) => {
  if (req.url === "/crash") {
    setTimeout(() => { missingFunction(); }, 0);
  }
  res.end("ok");
}).listen(Number(process.argv[2]), "127.0.0.1", () => console.log("node listening"));
process.on("uncaughtException", (err) => { console.error(err); });
"""


def _errors(app: AppClient, **params: object) -> list[dict[str, object]]:
    response = app.http.get("/v1/session/runtime-errors", params=params)
    assert response.status_code == 200, response.text
    errors: list[dict[str, object]] = response.json()["errors"]
    return errors


def _wait_for(app: AppClient, source: str, count: int) -> dict[str, object]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        found = [e for e in _errors(app) if e["source"] == source and e["count"] == count]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no error from {source} with count {count}: {_errors(app)}")


def test_python_traceback_is_one_error_counted_twice(app: AppClient) -> None:
    app.put("server_app.py", APP_SERVER)
    app.start("py", "exec python3 server_app.py 8401")
    app.wait_log("py", "app listening")
    before = time.time()
    for _ in range(2):
        assert app.preview(8401, "boom").status_code in (500, 502, 503)
    record = _wait_for(app, "process:py", 2)
    assert record["type"] == "NameError"
    assert record["category"] == "reference"
    assert record["message"] == "name 'undefined_helper' is not defined"
    assert record["file"] == "server_app.py"
    assert record["line"] == 11
    assert "in do_GET" in str(record["top_frame"])
    assert float(record["last_seen_s"]) >= float(record["first_seen_s"]) >= before - 1
    assert len([e for e in _errors(app) if e["source"] == "process:py"]) == 1


def test_python_syntax_error_at_start(app: AppClient) -> None:
    app.put("broken.py", "print('a')\ndef f(:\n    pass\n")
    app.start("broken", "python3 broken.py")
    info = app.wait_exited("broken")
    assert info["exit_code"] == 1
    record = _wait_for(app, "process:broken", 1)
    assert record["type"] == "SyntaxError"
    assert record["category"] == "syntax"
    assert (record["file"], record["line"]) == ("broken.py", 2)


def test_node_stack_trace(app: AppClient) -> None:
    app.put("server.js", NODE_SERVER)
    app.start("node", "exec node server.js 8402")
    app.wait_log("node", "node listening")
    app.preview(8402, "crash")
    record = _wait_for(app, "process:node", 1)
    assert record["type"] == "ReferenceError"
    assert record["message"] == "missingFunction is not defined"
    assert record["category"] == "reference"
    assert record["file"] == "server.js"
    assert record["line"] == 5
    assert record["column"] is not None
    app.preview(8402, "crash")
    assert _wait_for(app, "process:node", 2)["fingerprint"] == record["fingerprint"]


def test_network_errors_are_categorised(app: AppClient) -> None:
    code = "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:8499/', timeout=2)\n"
    app.put("fetcher.py", code)
    app.start("fetcher", "python3 fetcher.py")
    app.wait_exited("fetcher")
    record = _wait_for(app, "process:fetcher", 1)
    assert record["category"] == "network", record


def test_direct_report_since_and_clear(app: AppClient) -> None:
    mark = time.time()
    time.sleep(0.05)
    report = {
        "type": "Error",
        "message": f"request 123 failed at 0x7ffe{int(mark)} for '/tmp/x/{int(mark)}'",
        "url": "http://localhost/preview/a/main.js?v=9",
        "line": 3,
        "column": 7,
    }
    for variant in ("456", "789"):
        body = {**report, "message": report["message"].replace("123", variant)}
        response = app.http.post("/v1/session/runtime-errors", json=body)
        assert response.status_code == 204, response.text
    recent = _errors(app, since=mark)
    assert len(recent) == 1, recent
    assert recent[0]["count"] == 2
    assert recent[0]["file"] == "/preview/a/main.js"
    assert recent[0]["category"] == "other"
    assert _errors(app, since=time.time() + 60) == []
    assert app.http.get("/v1/session/runtime-errors", params={"since": "x"}).status_code == 400
    assert app.http.post("/v1/session/runtime-errors", json={"type": "E"}).status_code == 400
    assert app.http.delete("/v1/session/runtime-errors").status_code == 204
    assert _errors(app) == []
