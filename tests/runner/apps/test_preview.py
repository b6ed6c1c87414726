"""The preview: HTTP and WebSocket into the session's network namespace, and nothing else."""

from __future__ import annotations

import json
import os
import time

import httpx

from tests.fixtures.runner_process import RunnerProcess
from tests.runner.apps.helpers import WS_ECHO_SERVER, AppClient, ws_connect, ws_recv, ws_send

APP_PORT = 8201
WS_PORT = 8202
ODD_WS_PORT = 8203

# A WebSocket server that breaks the protocol the way a hostile app could: by path,
# a subprotocol the client never offered (not even a token), or a masked frame.
ODD_WS_SERVER = r"""
import base64, hashlib, socket, sys, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

def serve(conn):
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    lines = head.split(b"\r\n")
    path = lines[0].split()[1]
    key = [x.split(b": ", 1)[1] for x in lines if x.lower().startswith(b"sec-websocket-key:")]
    accept = base64.b64encode(hashlib.sha1(key[0] + GUID).digest())
    extra = b"Sec-WebSocket-Protocol: \x01zz\r\n" if path == b"/odd-protocol" else b""
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n" + extra
                 + b"\r\n")
    if path == b"/masked":
        conn.sendall(bytes([0x81, 0x80 | 6]) + b"\x01\x02\x03\x04"
                     + bytes(b ^ m for b, m in zip(b"secret", b"\x01\x02\x03\x04\x01\x02")))
    conn.recv(1)
    conn.close()

srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen()
print("odd ws listening", flush=True)
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


INDEX = "<!doctype html><html><HEAD><title>t</title></HEAD><body>hi</body></html>"


def _serve(app: AppClient) -> None:
    """The module's web app on APP_PORT (started by the first test that needs it)."""
    running = app.http.get("/v1/session/processes").json()["processes"]
    if not any(p["tag"] == "app" and p["state"] == "running" for p in running):
        app.put("index.html", INDEX)
        app.serve_app("app", APP_PORT)


def test_html_gets_the_reporter_script(app: AppClient) -> None:
    _serve(app)
    response = app.preview(APP_PORT, "index.html")
    assert response.status_code == 200
    body = response.text
    script = body.index("<script>")
    assert body.index("<title>t</title>") < script < body.index("</HEAD>")
    assert '"/v1/session/ports/8201/__sandcell/runtime-errors"' in body
    assert body.endswith("<body>hi</body></html>")
    assert int(response.headers["content-length"]) == len(response.content)
    assert response.headers.get_list("server") == ["uvicorn"]
    # The app sent Last-Modified (http.server, one-second resolution): a page with the
    # script in it carries no validator, so a reload is never answered 304 with the
    # old page after a write within the same second.
    assert app.preview(APP_PORT, "server_app.py").headers.get("last-modified")
    assert "last-modified" not in response.headers
    assert "etag" not in response.headers


def test_the_live_reload_channel_counts_file_writes(app: AppClient) -> None:
    """Served HTML polls <prefix>__sandcell/changes; its version moves with every file
    written or removed through the file routes (what an open tab reloads on), and a
    proxy whose app reloads itself (X-Sandcell-Live-Reload: 0) gets no poller."""
    _serve(app)
    page = app.preview(APP_PORT, "index.html", headers={"X-Forwarded-Prefix": "/preview/abc/"})
    assert '"/preview/abc/__sandcell/changes"' in page.text
    assert "location.reload()" in page.text
    changes = app.preview(APP_PORT, "__sandcell/changes")
    assert changes.headers["cache-control"] == "no-store"
    before = changes.json()["version"]
    app.put("notes/new.html", "<p>new</p>")
    assert app.preview(APP_PORT, "__sandcell/changes").json()["version"] == before + 1
    assert app.http.delete("/v1/session/files/notes/new.html").status_code == 204
    assert app.preview(APP_PORT, "__sandcell/changes").json()["version"] == before + 2
    # A page starts from the counter it was served at, so a write that lands before its
    # first poll still reloads it.
    assert f"seen = {before + 2};" in app.preview(APP_PORT, "index.html").text
    quiet = app.preview(APP_PORT, "index.html", headers={"X-Sandcell-Live-Reload": "0"})
    assert "__sandcell/changes" not in quiet.text
    assert "__sandcell/runtime-errors" in quiet.text


def test_forwarded_prefix_is_used_when_it_is_a_plain_path(app: AppClient) -> None:
    _serve(app)
    good = app.preview(APP_PORT, "index.html", headers={"X-Forwarded-Prefix": "/preview/abc/"})
    assert '"/preview/abc/__sandcell/runtime-errors"' in good.text
    hostile = app.preview(
        APP_PORT, "index.html", headers={"X-Forwarded-Prefix": "/x/</script><script>alert(1)//"}
    )
    assert "alert(1)" not in hostile.text
    assert '"/v1/session/ports/8201/__sandcell/runtime-errors"' in hostile.text


def test_other_content_passes_through_byte_identical(app: AppClient) -> None:
    _serve(app)
    blob = os.urandom(3 * 1024 * 1024 + 17)
    app.put("static/blob.bin", blob)
    response = app.preview(APP_PORT, "static/blob.bin")
    assert response.status_code == 200
    assert response.content == blob
    assert response.headers["content-length"] == str(len(blob))
    js = b"console.log('</head>')\n"
    app.put("static/app.js", js)
    assert app.preview(APP_PORT, "static/app.js").content == js


def test_gzipped_html_is_passed_on_untouched(app: AppClient) -> None:
    _serve(app)
    response = app.preview(APP_PORT, "gzipped")
    assert response.headers["content-encoding"] == "gzip"
    assert response.text == "<html><head></head><body>zipped</body></html>"


def test_request_details_reach_the_server_without_runner_secrets(app: AppClient) -> None:
    _serve(app)
    seen = app.preview(APP_PORT, "headers", headers={"X-Custom": "yes", "Accept-Encoding": "gzip"})
    received = {k.lower(): v for k, v in seen.json().items()}
    assert received["x-custom"] == "yes"
    assert received["host"] == f"localhost:{APP_PORT}"
    for secret in ("authorization", "x-runtime-session-id", "accept-encoding"):
        assert secret not in received, received
    assert app.runner.token not in seen.text
    echoed = app.http.post(f"/v1/session/ports/{APP_PORT}/echo?q=1", content=b"abc")
    assert echoed.content == b"cba"


def test_redirects_stay_under_the_prefix(app: AppClient) -> None:
    _serve(app)
    response = app.preview(APP_PORT, "redirect", headers={"X-Forwarded-Prefix": "/preview/i1/"})
    assert response.status_code == 302
    assert response.headers["location"] == "/preview/i1/target?x=1"


def test_nothing_listening_is_the_apps_own_502(app: AppClient) -> None:
    """An app that does not answer (not started, crashed) is 502 app_not_responding, told
    apart from a busy sandbox, and retryable: the app may still come up."""
    response = app.preview(8299)
    assert response.status_code == 502
    error = response.json()["error"]
    assert (error["code"], error["retryable"]) == ("app_not_responding", True)
    assert error["message"].startswith("the app did not answer")
    assert app.preview(70000).status_code == 400


def test_preview_needs_the_token_and_the_session(app: AppClient, app_runner: RunnerProcess) -> None:
    _serve(app)
    url = f"{app_runner.url}/v1/session/ports/{APP_PORT}/index.html"
    assert httpx.get(url, headers={"X-Runtime-Session-Id": app.session_id}).status_code == 401
    assert httpx.get(url, headers=app_runner.headers()).status_code == 400
    sock, head = ws_connect(app_runner, app.session_id, f"/v1/session/ports/{WS_PORT}/")
    sock.close()
    other = "rt_" + "0" * 64
    sock, head = ws_connect(app_runner, other, f"/v1/session/ports/{WS_PORT}/")
    sock.close()
    assert head.startswith(b"HTTP/1.1 409"), head


def test_websocket_echo_through_the_proxy(app: AppClient, app_runner: RunnerProcess) -> None:
    app.put("ws_echo.py", WS_ECHO_SERVER)
    app.start("ws", f"exec python3 ws_echo.py {WS_PORT}")
    app.wait_log("ws", "ws listening")
    sock, head = ws_connect(app_runner, app.session_id, f"/v1/session/ports/{WS_PORT}/hmr?t=1")
    try:
        assert head.startswith(b"HTTP/1.1 101"), head
        ws_send(sock, b"hello")
        assert ws_recv(sock) == (1, b"hello")
        big = os.urandom(200_000)
        ws_send(sock, big, opcode=2)
        assert ws_recv(sock) == (2, big)
        ws_send(sock, b"", opcode=8)
        assert ws_recv(sock)[0] == 8
    finally:
        sock.close()
    # The runner serves plain requests on as before.
    assert app.http.get("/v1/session/processes").status_code == 200


def _odd_ws(app: AppClient) -> None:
    running = app.http.get("/v1/session/processes").json()["processes"]
    if not any(p["tag"] == "odd-ws" and p["state"] == "running" for p in running):
        app.put("odd_ws.py", ODD_WS_SERVER)
        app.start("odd-ws", f"exec python3 odd_ws.py {ODD_WS_PORT}")
        app.wait_log("odd-ws", "odd ws listening")


def test_an_upstream_subprotocol_the_client_did_not_offer_is_refused(
    app: AppClient, app_runner: RunnerProcess
) -> None:
    """RFC 6455 4.1: the server picks one of the client's offers. Anything else (here not
    even a token, which the accept could not send: a 500) is the runner's refusal."""
    _odd_ws(app)
    sock, head = ws_connect(
        app_runner,
        app.session_id,
        f"/v1/session/ports/{ODD_WS_PORT}/odd-protocol",
        extra={"Sec-WebSocket-Protocol": "chat"},
    )
    try:
        body = sock.recv(4096)
    finally:
        sock.close()
    assert head.startswith(b"HTTP/1.1 503"), head
    assert json.loads(body)["error"]["message"].endswith("answered the WebSocket handshake wrongly")
    # The runner serves on as before.
    assert app.http.get("/v1/session/processes").status_code == 200


def test_a_masked_frame_from_the_upstream_ends_the_websocket(
    app: AppClient, app_runner: RunnerProcess
) -> None:
    """RFC 6455 5.1: a client fails the connection on a masked server frame (a browser
    would); the relay does too, rather than unmask it byte by byte in its event loop."""
    _odd_ws(app)
    sock, head = ws_connect(app_runner, app.session_id, f"/v1/session/ports/{ODD_WS_PORT}/masked")
    try:
        assert head.startswith(b"HTTP/1.1 101"), head
        opcode, payload = ws_recv(sock)
        assert (opcode, payload[:2]) == (8, (1011).to_bytes(2, "big")), (opcode, payload)
    finally:
        sock.close()


def test_refused_upgrade_is_relayed(app: AppClient, app_runner: RunnerProcess) -> None:
    _serve(app)
    sock, head = ws_connect(app_runner, app.session_id, f"/v1/session/ports/{APP_PORT}/index.html")
    sock.close()
    # http.server ignores Upgrade and answers the GET; no tunnel is made.
    assert head.startswith(b"HTTP/1.1 200"), head


def test_session_commands_share_the_namespace_but_not_the_outside(app: AppClient) -> None:
    """A later execute reaches the dev server on localhost; the internet and the host do not."""
    _serve(app)
    code = f"""
import socket, urllib.request
print(urllib.request.urlopen("http://localhost:{APP_PORT}/index.html").status)
for host, port in (("1.1.1.1", 80), ("127.0.0.1", {app.runner.port})):
    try:
        socket.create_connection((host, port), timeout=2)
        print("reached", host)
    except OSError as exc:
        print("blocked", host, type(exc).__name__)
"""
    result = app.execute(code)
    lines = result["stdout"].splitlines()
    assert lines[0] == "200", result
    assert lines[1].startswith("blocked 1.1.1.1"), result
    assert lines[2].startswith("blocked 127.0.0.1"), result


def test_browser_report_through_the_proxy_path(app: AppClient) -> None:
    report = {
        "type": "TypeError",
        "message": "Cannot read properties of undefined (reading 'map')",
        "stack": "TypeError: Cannot read properties of undefined (reading 'map')\n"
        f"    at App (http://localhost/preview/x/src/App.jsx?t={time.time_ns()}:12:19)\n"
        "    at renderWithHooks (http://localhost/preview/x/node_modules/react-dom.js:1:2)",
        "url": "http://localhost/preview/x/",
    }
    for _ in range(2):
        response = app.http.post(
            f"/v1/session/ports/{APP_PORT}/__sandcell/runtime-errors", content=json.dumps(report)
        )
        assert response.status_code == 204, response.text
    errors = app.http.get("/v1/session/runtime-errors").json()["errors"]
    browser = [e for e in errors if e["source"] == "browser"]
    assert len(browser) == 1
    record = browser[0]
    assert record["count"] == 2
    assert record["category"] == "type"
    assert record["file"] == "/preview/x/src/App.jsx"
    assert (record["line"], record["column"]) == (12, 19)
    bad = app.http.post(
        f"/v1/session/ports/{APP_PORT}/__sandcell/runtime-errors", content=b'{"type": 1}'
    )
    assert bad.status_code == 400
