"""Outputs over the runner's inline cap (1 MiB) are kept and download byte-exact, through
the real client and over plain HTTP, stateless and in a runtime session; past the run's
byte cap (``SANDCELL_LIBRECHAT_MAX_OUTPUT_BYTES``, 8 MiB in this folder's serve) an
output is named in ``artifact_delivery`` (``artifact_delivery_failed``, the code the client
reads; the output's own error says ``output_limit_exceeded``), and the client warns the model."""

from __future__ import annotations

import hashlib
from typing import Any

from tests.librechat.conftest import KEY_A, KEY_B, Driver, Serve
from tests.librechat.test_exec_files import current

MIB = 1 << 20


def blob(size: int, seed: str) -> bytes:
    """``size`` bytes that the job below produces the same way (no two blocks alike)."""
    blocks = (hashlib.sha256(f"{seed}{i}".encode()).digest() for i in range(size // 32 + 1))
    return b"".join(blocks)[:size]


def write_blob(name: str, size: int, seed: str) -> str:
    """Python for the job: write ``blob(size, seed)`` to ``/mnt/data/<name>``."""
    return (
        "import hashlib\n"
        f"data = b''.join(hashlib.sha256(f'{seed}{{i}}'.encode()).digest()"
        f" for i in range({size} // 32 + 1))[:{size}]\n"
        f"open('/mnt/data/{name}', 'wb').write(data)\n"
    )


def download(serve: Serve, file: dict[str, Any], key: str = KEY_A, user: str = "user-1") -> bytes:
    with serve.client(key) as client:
        got = client.get(
            f"/download/{file['storage_session_id']}/{file['id']}",
            params={"kind": "user", "id": user},
        )
    assert got.status_code == 200, got.text
    return got.content


def test_a_3_mib_output_downloads_byte_exact_through_the_client(
    serve: Serve, driver: Driver
) -> None:
    """The client's artifact names the file; the download is the job's bytes; the session's
    listing has it; tenant B gets exactly the missing-file answer for it."""
    run = driver.invoke(
        params=current(serve, user_id="user-1"),
        args={"lang": "py", "code": write_blob("big.bin", 3 * MIB, "a") + "print('done')"},
    )
    assert run["ok"], run
    assert run["content"].startswith("stdout:\ndone"), run
    (big,) = run["artifact"]["files"]
    assert big["name"] == "big.bin"
    assert download(serve, big) == blob(3 * MIB, "a")

    session = big["storage_session_id"]
    query = {"kind": "user", "id": "user-1"}
    with serve.client() as a, serve.client(KEY_B) as b:
        listing = a.get(f"/files/{session}", params={"detail": "full", **query})
        assert [(e["id"], e["metadata"]) for e in listing.json()] == [
            (big["id"], {"original-filename": "big.bin"})
        ]
        info = a.get(f"/sessions/{session}/objects/{big['id']}", params=query)
        assert info.json()["size"] == 3 * MIB
        missing = a.get(f"/download/{session}/{'x' * 21}", params=query)
        assert missing.status_code == 404
        other = b.get(f"/download/{session}/{big['id']}", params=query)
        assert (other.status_code, other.content) == (404, missing.content)
        assert b.get(f"/files/{session}", params=query).json() == []


def test_large_outputs_over_plain_http_stateless_and_in_a_session(serve: Serve) -> None:
    """POST /exec as any client sends it: a 3 MiB and a small output, no ``artifact_delivery``;
    then with a runtime session hint (the session path), a 2 MiB output kept too."""
    with serve.client() as client:
        answer = client.post(
            "/exec",
            json={
                "lang": "py",
                "user_id": "user-1",
                "code": write_blob("big.bin", 3 * MIB, "b")
                + "open('/mnt/data/small.txt', 'w').write('small')\n",
            },
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert "artifact_delivery" not in body, body
        files = {f["name"]: f for f in body["files"]}
        assert set(files) == {"big.bin", "small.txt"}
        assert download(serve, files["big.bin"]) == blob(3 * MIB, "b")
        assert download(serve, files["small.txt"]) == b"small"

        stateful = client.post(
            "/exec",
            headers={"X-CodeAPI-Expected-Profile": "stateful"},
            json={
                "lang": "py",
                "user_id": "user-1",
                "runtime_session_hint": "large-outputs",
                "code": write_blob("kept.bin", 2 * MIB, "c"),
            },
        )
        assert stateful.status_code == 200, stateful.text
        (kept,) = stateful.json()["files"]
        assert stateful.json()["runtime_session_id"].startswith("rt_")
        assert download(serve, kept) == blob(2 * MIB, "c")


def test_outputs_past_the_run_cap_are_named_with_a_code(serve: Serve) -> None:
    """Two 5 MiB outputs against the 8 MiB cap: one kept whole, the other named in
    ``artifact_delivery`` (its error ``output_limit_exceeded``), never half-kept."""
    code = write_blob("one.bin", 5 * MIB, "d") + write_blob("two.bin", 5 * MIB, "e")
    with serve.client() as client:
        answer = client.post("/exec", json={"lang": "py", "user_id": "user-1", "code": code})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    (kept,) = body["files"]
    seed = {"one.bin": "d", "two.bin": "e"}[kept["name"]]
    assert download(serve, kept) == blob(5 * MIB, seed)
    delivery = body["artifact_delivery"]
    (refused,) = delivery["errors"]
    assert refused["name"] == ({"one.bin", "two.bin"} - {kept["name"]}).pop()
    assert refused["code"] == "output_limit_exceeded"
    assert delivery["code"] == "artifact_delivery_failed"
    assert "SANDCELL_LIBRECHAT_MAX_OUTPUT_BYTES" in refused["message"]
    assert (delivery["status"], delivery["attempted"], delivery["delivered"]) == ("partial", 2, 1)


WARNING = (
    "Artifact delivery warning: {failed} of {attempted} generated files could not be persisted."
)


def test_the_client_warns_the_model_of_outputs_past_the_run_cap(
    serve: Serve, driver: Driver
) -> None:
    """Through the real client: one 5 MiB output kept and one refused (``partial``), then a
    lone 9 MiB output refused (``failed``). The client reads ``artifact_delivery`` only with
    the code ``artifact_delivery_failed`` and tells the model; any other code it drops, and
    the model would count on a file that is not there."""
    code = write_blob("one.bin", 5 * MIB, "g") + write_blob("two.bin", 5 * MIB, "h")
    run = driver.invoke(params=current(serve, user_id="user-1"), args={"lang": "py", "code": code})
    assert run["ok"], run
    assert WARNING.format(failed=1, attempted=2) in run["content"], run["content"]
    assert run["artifact"]["artifact_delivery"] == {
        "code": "artifact_delivery_failed",
        "status": "partial",
        "attempted": 2,
        "delivered": 1,
        "failed": 1,
    }
    (kept,) = run["artifact"]["files"]
    assert download(serve, kept) == blob(5 * MIB, {"one.bin": "g", "two.bin": "h"}[kept["name"]])

    lone = driver.invoke(
        tool="bash",
        params=current(serve, user_id="user-1"),
        args={"command": "head -c 9437184 /dev/zero > /mnt/data/nine.bin"},
    )
    assert lone["ok"], lone
    assert WARNING.format(failed=1, attempted=1) in lone["content"], lone["content"]
    assert lone["artifact"]["artifact_delivery"]["status"] == "failed"
    assert "files" not in lone["artifact"]


def test_a_programmatic_run_keeps_a_large_output(serve: Serve, driver: Driver) -> None:
    """The code-context path: a 2 MiB file written by programmatic code is kept."""
    done = driver.invoke(
        tool="ptc",
        params={"baseUrl": serve.base, "authHeaders": {"X-API-Key": KEY_A}},
        args={"code": write_blob("ptc.bin", 2 * MIB, "f") + "print('written')\n"},
        ptc_tools=[],
    )
    assert done["ok"], done
    (kept,) = done["artifact"]["files"]
    assert kept["name"] == "ptc.bin"
    assert download(serve, kept, user="anonymous") == blob(2 * MIB, "f")


def test_a_large_output_of_a_control_character_name_downloads(serve: Serve) -> None:
    """A 2 MiB output (read from the sandbox, not inlined) named with a newline, a tab and
    DEL is kept and downloads byte-exact under RFC 6266's ``filename*``; the runner's file
    route matched no such name, so it was refused as unreadable."""
    name = "a\nb\t\x7f.bin"
    code = write_blob("placeholder", 2 * MIB, "f").replace(
        "'/mnt/data/placeholder'", repr(f"/mnt/data/{name}")
    )
    with serve.client() as client:
        answer = client.post("/exec", json={"lang": "py", "user_id": "user-1", "code": code})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert "artifact_delivery" not in body, body
        (out,) = body["files"]
        assert out["name"] == name
        got = client.get(
            f"/download/{out['storage_session_id']}/{out['id']}",
            params={"kind": "user", "id": "user-1"},
        )
    assert got.status_code == 200, got.text
    assert got.content == blob(2 * MIB, "f")
    assert got.headers["content-disposition"] == (
        "attachment; filename=\"a_b__.bin\"; filename*=UTF-8''a%0Ab%09%7F.bin"
    )
