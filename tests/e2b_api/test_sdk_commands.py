"""E2B's SDK, unchanged, against ``sandcell serve``: lifecycle, commands, files, tenants.

Every test drives the real ``e2b`` package (sync and async) over real HTTP; the
sandboxes are real runner processes with nsjail underneath (local provider).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, CommandExitException, Sandbox
from e2b.exceptions import (
    NotFoundException,
    RateLimitException,
    SandboxException,
    TimeoutException,
)

from tests.e2b_api.conftest import DOMAIN, KEY_A, KEY_B, MAX_SANDBOXES, E2bServe
from tests.e2b_api.tls_front import tls_front


@pytest.fixture(scope="module")
def sbx(e2b_serve: E2bServe) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(envs={"FROM_CREATE": "created"}, **e2b_serve.opts())
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_echo_exit_codes_and_command_exit_exception(sbx: Sandbox) -> None:
    """``commands.run`` arrives as ``/bin/bash -l -c``; a non-zero exit raises with its output."""
    result = sbx.commands.run("echo hi")
    assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "", 0)

    with pytest.raises(CommandExitException) as raised:
        sbx.commands.run("echo out; echo err >&2; exit 3")
    assert raised.value.exit_code == 3
    assert raised.value.stdout == "out\n"
    assert raised.value.stderr == "err\n"


def test_callbacks_env_vars_and_cwd(sbx: Sandbox) -> None:
    """Output reaches the callbacks as produced; create-time and per-command envs apply;
    ``cwd`` is a path under ``/home/user``, the session workspace."""
    out: list[str] = []
    err: list[str] = []
    result = sbx.commands.run(
        "echo one; echo two >&2; echo $FROM_CREATE $PER_CALL",
        envs={"PER_CALL": "call"},
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "one\ncreated call\n" == result.stdout
    assert "".join(err) == "two\n"

    sbx.commands.run("mkdir -p sub/dir && echo x > sub/dir/f.txt")
    where = sbx.commands.run("pwd; cat f.txt; echo $HOME", cwd="/home/user/sub/dir")
    assert where.stdout == "/home/user/sub/dir\nx\n/home/user\n"
    relative = sbx.commands.run("pwd", cwd="sub")
    assert relative.stdout == "/home/user/sub\n"

    with pytest.raises(SandboxException):
        sbx.commands.run("pwd", cwd="/etc")


def test_background_command_listed_fed_and_killed(sbx: Sandbox) -> None:
    """A background command keeps running after the call, is listed, reads what is sent
    to its stdin, and ends when killed (its wait then raises)."""
    handle = sbx.commands.run("read line; echo got:$line; sleep 300", background=True, stdin=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert handle.pid in listed
    assert listed[handle.pid].args[-1].startswith("read line")

    sbx.commands.send_stdin(handle.pid, "hello\n")
    for stdout, _, _ in handle:
        if stdout and "got:" in stdout:
            break
    assert handle.kill() is True
    with pytest.raises(CommandExitException) as raised:
        handle.wait()
    assert raised.value.stdout == "got:hello\n"
    assert handle.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(handle.pid) is False


def test_close_stdin_ends_the_input(sbx: Sandbox) -> None:
    """``close_stdin`` is EOF for the process (``cat`` then exits 0)."""
    handle = sbx.commands.run("cat; echo done", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "abc")
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.stdout == "abcdone\n"


def test_files_http_write_and_read(sbx: Sandbox) -> None:
    """``files.write``/``read`` go through envd's HTTP ``/files``; the command sees them."""
    info = sbx.files.write("/home/user/notes/a.txt", "hello file")
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("notes/a.txt") == "hello file"
    sbx.files.write("bin.dat", b"\x00\xffdata")
    assert sbx.files.read("/home/user/bin.dat", format="bytes") == b"\x00\xffdata"
    assert sbx.commands.run("cat /home/user/notes/a.txt").stdout == "hello file"
    with pytest.raises(NotFoundException):
        sbx.files.read("missing.txt")


def test_control_plane_get_list_and_timeout(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """get_info, list (with a metadata filter) and set_timeout on the tenant's own sandbox."""
    tagged = Sandbox.create(metadata={"purpose": "listing"}, **e2b_serve.opts())
    try:
        info = Sandbox.get_info(tagged.sandbox_id, **e2b_serve.opts())
        assert info.metadata == {"purpose": "listing"}
        assert info.template_id == "base"
        from e2b import SandboxQuery

        found = Sandbox.list(
            query=SandboxQuery(metadata={"purpose": "listing"}), **e2b_serve.opts()
        ).next_items()
        assert [s.sandbox_id for s in found] == [tagged.sandbox_id]

        before = info.end_at
        tagged.set_timeout(3600)
        after = Sandbox.get_info(tagged.sandbox_id, **e2b_serve.opts()).end_at
        assert after > before
        assert tagged.is_running()
    finally:
        assert tagged.kill() is True
    assert Sandbox.kill(tagged.sandbox_id, **e2b_serve.opts()) is False


def test_second_tenant_cannot_see_or_connect(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """Another API key's tenant gets exactly the answers for a sandbox that does not exist."""
    other = e2b_serve.opts(KEY_B)
    listed = Sandbox.list(**other).next_items()
    assert sbx.sandbox_id not in {s.sandbox_id for s in listed}
    with pytest.raises(NotFoundException) as seen:
        Sandbox.get_info(sbx.sandbox_id, **other)
    with pytest.raises(NotFoundException) as missing:
        Sandbox.get_info("a" * 20, **other)
    assert str(seen.value).replace(sbx.sandbox_id, "ID") == str(missing.value).replace(
        "a" * 20, "ID"
    )
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, **other)
    assert Sandbox.kill(sbx.sandbox_id, **other) is False
    # envd without the sandbox's access token answers as for no sandbox at all.
    forged = httpx.post(
        f"{e2b_serve.url}/e2b/sandbox/process.Process/List",
        json={},
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "forged"},
    )
    absent = httpx.post(
        f"{e2b_serve.url}/e2b/sandbox/process.Process/List",
        json={},
        headers={"E2b-Sandbox-Id": "b" * 20, "X-Access-Token": "forged"},
    )
    assert forged.status_code == absent.status_code == 502
    assert sbx.commands.run("echo still mine").stdout == "still mine\n"


def test_unauthenticated_and_bad_requests(e2b_serve: E2bServe) -> None:
    """No key is a 401; a template that does not exist a 404; unknown fields a 400."""
    base = f"{e2b_serve.url}/e2b"
    assert httpx.get(f"{base}/v2/sandboxes").status_code == 401
    headers = {"X-API-KEY": e2b_serve.opts()["api_key"]}
    missing = httpx.post(f"{base}/v2/sandboxes", json={"templateID": "nope"}, headers=headers)
    assert missing.status_code == 404
    assert missing.json()["error_code"] == "not_found"
    unknown = httpx.post(
        f"{base}/v2/sandboxes", json={"templateID": "base", "bogus": 1}, headers=headers
    )
    assert unknown.status_code == 400
    assert unknown.json()["error_code"] == "bad_request"
    # Kept for later commands, so checked here: a bad name is this call's 400.
    for env in ({"A\x00": "b"}, {"": "b"}, {"1A": "b"}, {"A": "b\x00"}):
        refused = httpx.post(
            f"{base}/v2/sandboxes", json={"templateID": "base", "envVars": env}, headers=headers
        )
        assert (refused.status_code, refused.json()["error_code"]) == (400, "bad_request"), env
    # autoResume is not served: only its neutral value, and only its own shape.
    for resume in ({"enabled": True}, {"x": 1}, "yes"):
        body = {"templateID": "base", "autoResume": resume}
        refused = httpx.post(f"{base}/v2/sandboxes", json=body, headers=headers)
        assert (refused.status_code, refused.json()["error_code"]) == (400, "bad_request"), resume


def test_malformed_envd_bodies_are_4xx(e2b_serve: E2bServe, sbx: Sandbox) -> None:
    """A Connect body that does not decode is ``invalid_argument`` (400), and a broken
    multipart upload a 400 ``bad_request``: the caller's mistakes, never a 500."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""}
    envd = f"{e2b_serve.url}/e2b/sandbox"
    with httpx.Client(base_url=envd, headers=headers, timeout=60) as client:
        for rpc in ("/filesystem.Filesystem/Stat", "/process.Process/SendSignal"):
            for body in (b"", b"{", b"[]", b'{"process": {"pid": "x"}}'):
                answer = client.post(
                    rpc, content=body, headers={"content-type": "application/json"}
                )
                assert answer.status_code == 400, (rpc, body, answer.text)
                assert answer.json()["code"] == "invalid_argument"
        for body in (b"garbage", b""):
            broken = client.post(
                "/files?path=/home/user/x",
                content=body,
                headers={"content-type": "multipart/form-data; boundary=zz"},
            )
            assert broken.status_code == 400, broken.text
            assert broken.json()["error_code"] == "bad_request"
    with httpx.Client(base_url=envd, headers=headers, timeout=60) as client:
        for port in ("49983", "49999"):
            lost = client.get("/no/such/route", headers={"E2b-Sandbox-Port": port})
            assert (lost.status_code, lost.json()["error_code"]) == (404, "not_found"), port
    assert sbx.commands.run("echo still fine").stdout == "still fine\n"


async def test_async_sdk_runs_commands(e2b_serve: E2bServe) -> None:
    """``AsyncSandbox``: create, run, background with stdin, kill."""
    sandbox = await AsyncSandbox.create(**e2b_serve.opts())
    try:
        result = await sandbox.commands.run("echo async hi")
        assert result.stdout == "async hi\n"
        with pytest.raises(CommandExitException) as raised:
            await sandbox.commands.run("exit 7")
        assert raised.value.exit_code == 7
        echoed = asyncio.Event()
        handle = await sandbox.commands.run(
            "read x; echo got:$x; sleep 300",
            background=True,
            stdin=True,
            on_stdout=lambda line: echoed.set(),
        )
        assert handle.pid in {p.pid for p in await sandbox.commands.list()}
        await sandbox.commands.send_stdin(handle.pid, "async\n")
        await asyncio.wait_for(echoed.wait(), 30)
        assert await handle.kill() is True
        with pytest.raises(CommandExitException) as killed:
            await handle.wait()
        assert killed.value.stdout == "got:async\n"
        await sandbox.files.write("a.txt", "async file")
        assert await sandbox.files.read("/home/user/a.txt") == "async file"
    finally:
        assert await sandbox.kill() is True


def test_host_routed_form(e2b_serve: E2bServe) -> None:
    """E2B_DOMAIN's form: ``api.{domain}`` is the control plane and
    ``{port}-{id}.{domain}`` a sandbox's envd, routed by ``Host`` alone (the SDK adds
    TLS; a terminator in front of sandcell removes it)."""
    with httpx.Client(base_url=e2b_serve.url, timeout=60) as client:
        created = client.post(
            "/v2/sandboxes",
            json={"templateID": "base"},
            headers={"Host": f"api.{DOMAIN}", "X-API-KEY": KEY_A},
        )
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["domain"] == DOMAIN
        sandbox_host = f"49983-{body['sandboxID']}.{DOMAIN}"
        envd = {"Host": sandbox_host, "X-Access-Token": body["envdAccessToken"]}
        try:
            written = client.post(
                "/files", params={"path": "h.txt"}, content=b"via host", headers=envd
            )
            assert written.status_code == 200, written.text
            assert written.json()[0]["path"] == "/home/user/h.txt"
            read = client.get("/files", params={"path": "/home/user/h.txt"}, headers=envd)
            assert read.content == b"via host"
            listed = client.post(
                "/process.Process/List",
                json={},
                headers={**envd, "Content-Type": "application/json"},
            )
            assert listed.status_code == 200, listed.text
            assert client.get("/health", headers=envd).status_code == 204
            other = client.get("/health", headers={**envd, "Host": f"49983-{'c' * 20}.{DOMAIN}"})
            assert other.status_code == 502
        finally:
            client.delete(
                f"/sandboxes/{body['sandboxID']}",
                headers={"Host": f"api.{DOMAIN}", "X-API-KEY": KEY_A},
            )


def test_users_user_and_root_are_the_same_pinned_uid(sbx: Sandbox) -> None:
    """``user="root"`` runs as the session's unprivileged UID, as ``user`` does."""
    as_user = sbx.commands.run("id -u").stdout
    as_root = sbx.commands.run("id -u", user="root").stdout
    assert as_user == as_root
    assert as_user.strip() != "0"


def test_a_command_timeout_ends_the_process(sbx: Sandbox) -> None:
    """The SDK's ``timeout`` is the Start stream's deadline, and ends the process too."""
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 60; echo never", timeout=1)
    deadline = time.monotonic() + 30
    while any("sleep 60" in " ".join(p.args) for p in sbx.commands.list()):
        assert time.monotonic() < deadline, "the timed-out command is still running"
        time.sleep(0.1)


def test_stream_input_and_uploads(sbx: Sandbox) -> None:
    """``stream_input`` feeds stdin in order; gzip octet-stream and multi-file uploads land."""
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(handle.pid, iter(["one ", b"two"]))
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "one two"

    sbx.files.write("gz.txt", "compressed on the wire", gzip=True)
    assert sbx.files.read("gz.txt") == "compressed on the wire"
    written = sbx.files.write_files(
        [
            {"path": "multi/1.txt", "data": "first"},
            {"path": "/home/user/multi/2.bin", "data": b"\x02"},
        ]
    )
    assert sorted(w.path for w in written) == ["/home/user/multi/1.txt", "/home/user/multi/2.bin"]
    assert sbx.files.read("multi/2.bin", format="bytes") == b"\x02"


def test_idempotency_paging_and_the_tenant_cap(e2b_serve: E2bServe) -> None:
    """A retried create with one Idempotency-Key makes one sandbox; listings page with
    ``limit``/``nextToken``; a tenant past its running-sandbox cap gets a 429."""
    other = e2b_serve.opts(KEY_B)
    first = Sandbox.create(idempotency_key="retry-1", **other)
    made = [first]
    try:
        again = Sandbox.create(idempotency_key="retry-1", **other)
        assert again.sandbox_id == first.sandbox_id
        while len(made) < MAX_SANDBOXES:
            made.append(Sandbox.create(**other))
        with pytest.raises(RateLimitException):
            Sandbox.create(**other)

        pages = Sandbox.list(limit=2, **other)
        seen = pages.next_items()
        assert len(seen) == 2
        assert pages.has_next
        seen += pages.next_items()
        assert not pages.has_next
        assert sorted(s.sandbox_id for s in seen) == sorted(s.sandbox_id for s in made)
    finally:
        for sandbox in made:
            sandbox.kill()


_DOMAIN_SCRIPT = """
import json, os
from e2b import Sandbox
sandbox = Sandbox.create(proxy=os.environ["FRONT"])
out = sandbox.commands.run("echo over tls").stdout
sandbox.files.write("tls.txt", "via the domain form")
print(json.dumps({"id": sandbox.sandbox_id, "out": out, "file": sandbox.files.read("tls.txt"),
                  "killed": sandbox.kill()}))
"""


def test_the_sdk_in_the_e2b_domain_form(e2b_serve: E2bServe, tmp_path: Path) -> None:
    """The SDK with only ``E2B_DOMAIN`` (https://api.{domain}, https://49983-{id}.{domain})
    through a TLS terminator in front of sandcell serve, as docs/e2b.md deploys it."""
    with tls_front(tmp_path, domain=DOMAIN, upstream_port=e2b_serve.port) as (front, ca):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "SANDCELL_"))}
        env.update(E2B_DOMAIN=DOMAIN, E2B_API_KEY=KEY_A, SSL_CERT_FILE=str(ca), FRONT=front)
        done = subprocess.run(
            [sys.executable, "-c", _DOMAIN_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["out"] == "over tls\n"
    assert result["file"] == "via the domain form"
    assert result["killed"] is True
