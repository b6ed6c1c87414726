"""The input cache over HTTP (push, probe, pull on miss) and priming into workspaces."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sandcell_protocol import input_cache_key
from tests.fixtures.runner_process import RunnerProcess
from tests.golden import load_golden
from tests.runner.conftest import StartRunner
from tests.runner.helpers import execute
from tests.runner.session.helpers import SessionClient


def push(
    runner: RunnerProcess,
    objects: list[tuple[str, str, bytes]],
    *,
    manifest_override: dict[str, Any] | None = None,
) -> httpx.Response:
    manifest = {
        "objects": {
            input_cache_key(ss, oid): {
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "read_only": False,
            }
            for ss, oid, data in objects
        }
    }
    if manifest_override:
        manifest["objects"].update(manifest_override)
    files: list[tuple[str, tuple[str | None, bytes, str]]] = [
        ("manifest", (None, json.dumps(manifest).encode(), "application/json"))
    ]
    files += [
        ("object", (input_cache_key(ss, oid), data, "application/octet-stream"))
        for ss, oid, data in objects
    ]
    return httpx.post(runner.url + "/v1/inputs", files=files, headers=runner.headers())


def probe(runner: RunnerProcess, refs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    response = httpx.post(
        runner.url + "/v1/inputs/probe", json={"refs": refs}, headers=runner.headers()
    )
    assert response.status_code == 200, response.text
    missing: list[dict[str, Any]] = response.json()["missing"]
    return missing


def ref(ss: str, oid: str, name: str, *, read_only: bool = False) -> dict[str, Any]:
    return {"storage_session": ss, "object_id": oid, "name": name, "read_only": read_only}


def cache_listing(runner: RunnerProcess) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(runner.input_cache.iterdir()) if p.is_file()}


def test_cache_keys_match_golden_vectors(runner: RunnerProcess) -> None:
    golden = load_golden()["input_cache_key"]
    objects = [(v["storage_session"], v["object_id"], b"golden") for v in golden]
    assert push(runner, objects).status_code == 200
    names = set(cache_listing(runner))
    for vector in golden:
        assert vector["key"] in names


def test_probe_push_and_prime(runner: RunnerProcess) -> None:
    refs = [ref("s1", "o1", "data/in.csv"), ref("s1", "o2", "other.txt")]
    assert probe(runner, refs) == refs
    response = push(runner, [("s1", "o1", b"a,b\n1,2\n")])
    assert response.status_code == 200, response.text
    assert probe(runner, refs) == [refs[1]]
    result = execute(
        runner,
        language="bash",
        code="cat data/in.csv",
        files=[refs[0], ref("s1", "o1", "copy.csv")],
    )
    assert result["stdout"] == "a,b\n1,2\n"
    # Primed inputs are not outputs.
    assert result["files"] == []
    # The cache never holds a file name.
    for name, content in cache_listing(runner).items():
        assert "in.csv" not in name
        assert b"in.csv" not in content


@pytest.mark.parametrize(
    "override",
    [
        {"size": 999},
        {"sha256": "0" * 64},
    ],
)
def test_manifest_mismatch_rejected_cache_unchanged(
    runner: RunnerProcess, override: dict[str, Any]
) -> None:
    before = cache_listing(runner)
    data = b"payload"
    key = input_cache_key("s2", "bad")
    manifest = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **override}
    response = push(runner, [("s2", "bad", data)], manifest_override={key: manifest})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_request"
    assert cache_listing(runner) == before


def test_miss_without_server_is_input_missing(runner: RunnerProcess) -> None:
    response = httpx.post(
        runner.url + "/v1/execute",
        json={"language": "bash", "code": "true", "files": [ref("nope", "nothing", "x.txt")]},
        headers=runner.headers(),
    )
    assert response.status_code == 400
    body = response.json()["error"]
    assert body["code"] == "input_missing"
    assert "nothing" in body["message"]


class _FileServer(http.server.ThreadingHTTPServer):
    objects: dict[tuple[str, str], bytes]
    requests: list[str]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _FileServer

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        parts = [urllib.parse.unquote(p) for p in self.path.split("/")]
        data = self.server.objects.get((parts[2], parts[3])) if len(parts) == 4 else None
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def file_server() -> Iterator[_FileServer]:
    server = _FileServer(("127.0.0.1", 0), _Handler)
    server.objects = {("store", "obj-1"): b"pulled bytes", ("..", "obj-1"): b"escaped"}
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_miss_pulls_from_file_server(runner_factory: StartRunner, file_server: _FileServer) -> None:
    host, port = file_server.server_address[:2]
    runner = runner_factory(SANDCELL_FILE_SERVER_URL=f"http://{host!s}:{port}")
    result = execute(
        runner,
        language="bash",
        code="cat a.txt; echo; cat b/a.txt",
        files=[ref("store", "obj-1", "a.txt"), ref("store", "obj-1", "b/a.txt")],
    )
    assert result["stdout"] == "pulled bytes\npulled bytes", result
    assert file_server.requests == ["/files/store/obj-1"]
    assert input_cache_key("store", "obj-1") in cache_listing(runner)
    # A ref the protocol refuses is a 400 before any pull (the file server would answer it).
    for bad in (ref("..", "obj-1", "c.txt"), ref("store", "obj/1", "c.txt")):
        response = httpx.post(
            runner.url + "/v1/execute",
            json={"language": "bash", "code": "cat c.txt", "files": [bad]},
            headers=runner.headers(),
            timeout=60,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "bad_request"
    assert file_server.requests == ["/files/store/obj-1"]


def test_priming_dedup_and_read_only_revert(session_runner: RunnerProcess) -> None:
    assert (
        push(
            session_runner,
            [("s", "w", b"writable v1"), ("s", "r", b"pristine"), ("s", "w2", b"v2")],
        ).status_code
        == 200
    )
    files = [ref("s", "w", "w.txt"), ref("s", "r", "r.txt", read_only=True)]
    with SessionClient(session_runner) as session:
        first = session.execute(
            "import os\n"
            "print(open('w.txt').read(), open('r.txt').read(), os.stat('r.txt').st_uid, "
            "oct(os.stat('r.txt').st_mode & 0o777))\n"
            "open('w.txt', 'w').write('edited by sandbox')\n"
            "os.remove('r.txt'); open('r.txt', 'w').write('tampered')\n",
            files=files,
        )
        # Root-owned on the host, so the unmapped overflow UID (nobody) inside the jail.
        assert first["stdout"] == "writable v1 pristine 65534 0o444\n", first
        second = session.execute("print(open('w.txt').read(), open('r.txt').read())", files=files)
        # The sandbox's edit of a writable input wins; the read-only one is reverted.
        assert second["stdout"] == "edited by sandbox pristine\n", second
        third = session.execute("print(open('w.txt').read())", files=[ref("s", "w2", "w.txt")])
        # A different ref at the same path replaces it.
        assert third["stdout"] == "v2\n"
