"""``@librechat/agents`` (3.9.2 and 3.1.63) runs code and moves files through a real serve."""

from __future__ import annotations

from typing import Any

from tests.librechat.conftest import KEY_A, KEY_B, Driver, Serve

BINARY = bytes(range(256)) * 64 + b"\x00end"


def current(serve: Serve, key: str = KEY_A, **params: Any) -> dict[str, Any]:
    """The 3.9.2 tool factory's parameters: LibreChat's server supplies the auth headers."""
    return {"baseUrl": serve.base, "authHeaders": {"X-API-Key": key}, **params}


def test_py_and_bash_run_through_the_current_client(serve: Serve, driver: Driver) -> None:
    """execute_code (py, ts, c, js) and the bash tool return the program's output, with args."""
    py = driver.invoke(
        params=current(serve, user_id="user-1"),
        args={"lang": "py", "code": "import sys; print('py', 6 * 7, sys.argv[1:])", "args": ["x"]},
    )
    assert py["ok"], py
    assert py["content"].startswith("stdout:\npy 42 ['x']")
    assert len(py["artifact"]["session_id"]) == 21

    bash = driver.invoke(
        tool="bash",
        params=current(serve),
        args={"command": 'echo "bash $BASH_VERSION" | cut -c1-6; echo oops >&2'},
    )
    assert bash["ok"], bash
    assert bash["content"].startswith("stdout:\nbash 5")
    assert "stderr:\noops" in bash["content"]

    ts = driver.invoke(
        params=current(serve),
        args={
            "lang": "ts",
            "code": "const n: number = 40;\nconsole.log(n + 2, process.argv.slice(2));",
            "args": ["t"],
        },
    )
    assert ts["ok"], ts
    assert ts["content"].startswith("stdout:\n42 [ 't' ]")
    c_source = '#include <stdio.h>\nint main(int n, char **v) { printf("c %s\\n", v[1]); }\n'
    c = driver.invoke(params=current(serve), args={"lang": "c", "code": c_source, "args": ["ok"]})
    assert c["ok"], c
    assert c["content"].startswith("stdout:\nc ok"), c
    js = driver.invoke(params=current(serve), args={"lang": "js", "code": "console.log(1 + 1)"})
    assert js["ok"], js
    assert js["content"].startswith("stdout:\n2"), js


def test_an_uploaded_file_is_used_and_an_output_downloads_byte_identical(
    serve: Serve, driver: Driver
) -> None:
    """Upload as LibreChat's server does, inject the ref, run, download what the run wrote."""
    uploaded = serve.upload([("data.bin", BINARY)])
    assert uploaded.status_code == 200, uploaded.text
    body = uploaded.json()
    assert body["message"] == "success"
    assert "session_id" not in body
    storage, file_id = body["storage_session_id"], body["files"][0]["fileId"]
    assert len(storage) == len(file_id) == 21
    ref = {
        "id": file_id,
        "resource_id": "user-1",
        "name": "data.bin",
        "storage_session_id": storage,
        "kind": "user",
    }

    run = driver.invoke(
        params=current(serve, user_id="user-1"),
        args={
            "lang": "py",
            "code": (
                "data = open('/mnt/data/data.bin', 'rb').read()\n"
                "print(len(data))\n"
                "open('/mnt/data/out.bin', 'wb').write(data[::-1])\n"
                "open('data.bin', 'ab').write(b'+')\n"
            ),
        },
        _injected_files=[ref],
    )
    assert run["ok"], run
    assert run["content"].startswith(f"stdout:\n{len(BINARY)}")
    files = {f["name"]: f for f in run["artifact"]["files"]}
    assert set(files) == {"out.bin", "data.bin"}
    out = files["out.bin"]
    assert out["storage_session_id"] == run["artifact"]["session_id"]
    assert files["data.bin"]["modified_from"] == {"id": file_id, "storage_session_id": storage}

    query = {"kind": "user", "id": "user-1"}
    with serve.client() as client:
        download = client.get(f"/download/{out['storage_session_id']}/{out['id']}", params=query)
        assert download.status_code == 200
        assert download.content == BINARY[::-1]
        info = client.get(
            f"/sessions/{out['storage_session_id']}/objects/{out['id']}", params=query
        )
        assert info.status_code == 200
        assert info.json()["size"] == len(BINARY)
        listing = client.get(f"/files/{storage}", params={"detail": "full", **query})
        assert listing.status_code == 200
        assert [(e["id"], e["metadata"]) for e in listing.json()] == [
            (file_id, {"original-filename": "data.bin"})
        ]
        assert client.delete(f"/files/{storage}/{file_id}").status_code == 204
        assert client.get(f"/download/{storage}/{file_id}", params=query).status_code == 404

    gone = driver.invoke(
        params=current(serve, user_id="user-1"),
        args={"lang": "py", "code": "print(1)"},
        _injected_files=[ref],
    )
    assert not gone["ok"], gone
    assert "rejected" in gone["error"], gone


def test_the_legacy_client_with_x_api_key(serve: Serve, driver: Driver) -> None:
    """3.1.63: the key as a parameter (sent as X-API-Key and in the body), legacy file refs
    ``{id, name, session_id}`` and the legacy upload answer."""
    uploaded = serve.upload([("in.txt", b"legacy input\n")], kind=None)
    assert uploaded.status_code == 200, uploaded.text
    body = uploaded.json()
    assert "storage_session_id" not in body
    ref = {"id": body["files"][0]["fileId"], "name": "in.txt", "session_id": body["session_id"]}

    run = driver.invoke(
        version="legacy",
        params={"LIBRECHAT_CODE_API_KEY": KEY_A},
        args={"lang": "py", "code": "print(open('in.txt').read().upper(), end='')"},
        _injected_files=[ref],
    )
    assert run["ok"], run
    assert run["content"].startswith("stdout:\nLEGACY INPUT")

    refused = driver.invoke(
        version="legacy",
        params={"LIBRECHAT_CODE_API_KEY": "not-a-key-0123456789"},
        args={"lang": "py", "code": "print(1)"},
    )
    assert not refused["ok"], refused
    assert "401" in refused["error"], refused
    assert "not-a-key-0123456789" not in serve.log.read_text()


def test_tenants_and_users_are_walls_and_bad_ids_are_400(serve: Serve, driver: Driver) -> None:
    """Tenant B, or another user of tenant A, gets 404 for A's file exactly as for a
    missing one; a ref to A's file from B is an unknown input; malformed ids are 400."""
    uploaded = serve.upload([("secret.txt", b"tenant A only")], user="alice").json()
    storage, file_id = uploaded["storage_session_id"], uploaded["files"][0]["fileId"]
    path = f"/download/{storage}/{file_id}"
    with serve.client() as a, serve.client(KEY_B) as b:
        assert a.get(path, params={"kind": "user", "id": "alice"}).content == b"tenant A only"
        missing = a.get(f"/download/{storage}/{'x' * 21}", params={"kind": "user", "id": "alice"})
        assert missing.status_code == 404
        for client, user in ((b, "alice"), (a, "mallory")):
            other = client.get(path, params={"kind": "user", "id": user})
            assert (other.status_code, other.content) == (404, missing.content)
            listing = client.get(f"/files/{storage}", params={"kind": "user", "id": user})
            assert listing.json() == []
        for bad in ("short", "x" * 22, "bad!id-0123456789abcd", "a.b.c.d.e.f.g.h.i.j.k"):
            assert a.get(f"/download/{bad}/{file_id}").status_code == 400, bad
            assert a.get(f"/download/{storage}/{bad}").status_code == 400, bad
        assert b.delete(f"/files/{storage}/{file_id}").status_code == 204
        assert a.get(path, params={"kind": "user", "id": "alice"}).status_code == 200

    ref = {"id": file_id, "name": "s.txt", "storage_session_id": storage, "kind": "user"}
    crossed = driver.invoke(
        params=current(serve, KEY_B), args={"lang": "py", "code": "print(1)"}, _injected_files=[ref]
    )
    assert not crossed["ok"], crossed
    assert "rejected" in crossed["error"], crossed
    unsupported = driver.invoke(params=current(serve), args={"lang": "f90", "code": "x"})
    assert not unsupported["ok"]
    assert "rejected" in unsupported["error"]


def test_a_stateful_hint_keeps_files_and_an_installed_package_across_calls(
    serve: Serve, driver: Driver
) -> None:
    """With statefulSessions and the stateful profile, three calls share one runtime
    session's /mnt/data: a file written first, a package pip-installed second, both used
    third; another hint is a different, empty session."""
    params = current(
        serve,
        user_id="user-1",
        statefulSessions=True,
        executionProfile="stateful",
        runtimeSessionHint="conv-1",
    )
    first = driver.invoke(
        params=params,
        args={
            "lang": "py",
            "code": (
                "import os\n"
                "os.makedirs('/mnt/data/pkg', exist_ok=True)\n"
                "open('/mnt/data/pkg/hello_sandcell.py', 'w').write('def hi(): return \"hi\"\\n')\n"
                "open('/mnt/data/pkg/setup.py', 'w').write("
                '\'from setuptools import setup\\nsetup(name="hello-sandcell", version="1.0", '
                'py_modules=["hello_sandcell"])\\n\')\n'
                "open('/mnt/data/state.txt', 'w').write('turn one')\n"
            ),
        },
    )
    assert first["ok"], first
    session = first["artifact"]["runtime_session_id"]
    assert session.startswith("rt_")
    # The client echoes runtime_status beside runtime_session_id (it was absent).
    assert first["artifact"]["runtime_status"] == "new"

    second = driver.invoke(
        tool="bash",
        params=params,
        args={
            "command": (
                "cd /mnt/data && python3 -m pip install -q --no-index --no-build-isolation "
                "--target /mnt/data/site ./pkg 2>&1 | tail -1; ls site | grep -c hello"
            )
        },
    )
    assert second["ok"], second
    assert second["artifact"]["runtime_session_id"] == session
    assert second["artifact"]["runtime_status"] == "reused"

    third = driver.invoke(
        params=params,
        args={
            "lang": "py",
            "code": (
                "import sys; sys.path.insert(0, '/mnt/data/site')\n"
                "import hello_sandcell\n"
                "print(hello_sandcell.hi(), open('/mnt/data/state.txt').read())\n"
            ),
        },
    )
    assert third["ok"], third
    assert third["content"].startswith("stdout:\nhi turn one"), third

    other = driver.invoke(
        params={**params, "runtimeSessionHint": "conv-2"},
        args={"lang": "py", "code": "import os; print(os.path.exists('/mnt/data/state.txt'))"},
    )
    assert other["content"].startswith("stdout:\nFalse"), other


def test_a_broken_multipart_upload_is_400(serve: Serve) -> None:
    """A multipart body that does not parse is the caller's mistake (400), not a 500."""
    with serve.client() as client:
        for body, content_type in (
            (b"garbage", "multipart/form-data; boundary=zz"),
            (b"", "multipart/form-data"),
        ):
            answer = client.post("/upload", content=body, headers={"content-type": content_type})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"] == "bad_request"


def test_a_bad_file_name_is_400_before_any_run(serve: Serve) -> None:
    """files[].name is checked at the door by the protocol's workspace-path rule."""
    uploaded = serve.upload([("in.txt", b"x")], user="alice").json()
    ref = {
        "id": uploaded["files"][0]["fileId"],
        "storage_session_id": uploaded["storage_session_id"],
        "kind": "user",
    }
    with serve.client() as client:
        for name in ("../escape.txt", "/mnt/data/in.txt", "a\\b"):
            answer = client.post(
                "/exec", json={"lang": "py", "code": "print(1)", "files": [{**ref, "name": name}]}
            )
            assert answer.status_code == 400, answer.text
            assert "files[].name" in answer.text, answer.text


def test_a_file_of_any_name_downloads_with_its_name(serve: Serve) -> None:
    """A name a header cannot carry as it is (not Latin-1, a control character), uploaded
    or written by a run, downloads under RFC 6266's ``filename*``; was a 500."""
    uploaded = serve.upload([("报告.txt", b"report")], user="alice").json()
    with serve.client(**{"User-Id": "alice"}) as client:
        path = f"/download/{uploaded['storage_session_id']}/{uploaded['files'][0]['fileId']}"
        answer = client.get(path, params={"kind": "user", "id": "alice"})
        assert answer.status_code == 200, answer.text
        assert answer.content == b"report"
        disposition = answer.headers["content-disposition"]
        assert disposition.endswith("filename*=UTF-8''%E6%8A%A5%E5%91%8A.txt"), disposition
        run = client.post(
            "/exec",
            json={"lang": "py", "code": "open('/mnt/data/a\\nb.txt', 'w').write('y')"},
        ).json()
        (out,) = run["files"]
        assert out["name"] == "a\nb.txt", run
        answer = client.get(f"/download/{run['session_id']}/{out['id']}")
        assert answer.status_code == 200, answer.text
        assert answer.content == b"y"
        assert answer.headers["content-disposition"] == (
            "attachment; filename=\"a_b.txt\"; filename*=UTF-8''a%0Ab.txt"
        )


def test_an_upload_version_past_int_parsing_is_400(serve: Serve) -> None:
    """``version`` of more digits than Python parses (4300) is a 400 like any bad one."""
    with serve.client(**{"User-Id": "alice"}) as client:
        answer = client.post(
            "/upload",
            data={"kind": "user", "id": "alice", "version": "9" * 5000},
            files=[("file", ("v.txt", b"x"))],
        )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "bad_request"


def test_inputs_the_code_deletes_are_named_in_deleted_files(serve: Serve, driver: Driver) -> None:
    """The client's ToolNode drops a file from its conversation's session only when an
    answer's ``deleted_files`` names it (absence from ``files`` is no signal): without it
    a file the code removed came back in the next call. A removed file, one in a removed
    directory, and not a kept or rewritten one; a run that removes nothing names none."""
    uploaded = serve.upload([("a.csv", b"a"), ("b.csv", b"b"), ("c.txt", b"c")], batch=True)
    assert uploaded.status_code == 200, uploaded.text
    body = uploaded.json()
    names = {"a.csv": "a.csv", "b.csv": "sub/b.csv", "c.txt": "c.txt"}
    refs = [
        {
            "id": item["fileId"],
            "resource_id": "user-1",
            "name": names[item["filename"]],
            "storage_session_id": body["storage_session_id"],
            "kind": "user",
        }
        for item in body["files"]
    ]
    both = [*refs, {**refs[0], "name": "again.csv"}]
    run = driver.invoke(
        params=current(serve, user_id="user-1"),
        args={
            "lang": "py",
            "code": (
                "import os, shutil\n"
                "os.remove('/mnt/data/a.csv')\n"
                "shutil.rmtree('/mnt/data/sub')\n"
                "os.remove('/mnt/data/again.csv')\n"
                "open('/mnt/data/again.csv', 'w').write('new')\n"
                "print(sorted(os.listdir('/mnt/data')))\n"
            ),
        },
        _injected_files=both,
    )
    assert run["ok"], run
    assert run["content"].startswith("stdout:\n['again.csv', 'c.txt']"), run
    assert sorted(run["artifact"]["deleted_files"]) == ["a.csv", "sub/b.csv"]
    assert [f["name"] for f in run["artifact"]["files"]] == ["again.csv"]

    untouched = driver.invoke(
        params=current(serve, user_id="user-1"),
        args={"lang": "py", "code": "print(open('/mnt/data/c.txt').read())"},
        _injected_files=refs,
    )
    assert untouched["ok"], untouched
    assert "deleted_files" not in untouched["artifact"], untouched
