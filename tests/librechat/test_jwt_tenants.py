"""LibreChat's tokens as its server mints them (``packages/api/src/auth/codeapi.ts``):
``iat`` and ``nbf`` its whole second now, and a ``tenant_id`` (``legacy`` for its single
tenant), through the real client against a real serve."""

from __future__ import annotations

import time
from typing import Any

from tests.librechat.conftest import Driver, Serve
from tests.librechat.test_auth_limits import run_as, token


def minted(sub: str = "jwt-user", *, ahead_s: int = 0, **claims: Any) -> str:
    """A token as LibreChat mints it, on a clock ``ahead_s`` seconds ahead of this host's."""
    now = int(time.time()) + ahead_s
    return token(
        sub=sub,
        iat=now,
        nbf=now,
        exp=now + 300,
        jti=f"jti-{sub}-{now}",
        role="USER",
        principal_source="librechat_jwt",
        auth_context_hash="0" * 64,
        **claims,
    )


def test_a_token_from_a_clock_a_little_ahead_is_accepted(serve: Serve, driver: Driver) -> None:
    """LibreChat signs ``iat``/``nbf`` as its current second and sends the token at once:
    a host whose clock is a moment behind saw it as issued in the future and refused
    it ("not authorized"). Within the leeway it runs; minutes ahead it is still refused."""
    for ahead in (2, 30):
        ok = run_as(driver, serve, minted(ahead_s=ahead, tenant_id="legacy"), "print('on time')")
        assert ok["ok"], ok
        assert ok["content"].startswith("stdout:\non time"), ok
    late = run_as(driver, serve, minted(ahead_s=600, tenant_id="legacy"))
    assert not late["ok"]
    assert "not authorized" in late["error"], late


def _upload_agent_file(serve: Serve, bearer: str) -> dict[str, Any]:
    """An agent file, uploaded as LibreChat's server does with the tenant's token."""
    with serve.client(None, Authorization=f"Bearer {bearer}") as client:
        answer = client.post(
            "/upload",
            data={"kind": "agent", "id": "agent_shared123"},
            files=[("file", ("notes.txt", b"tenant one's notes"))],
        )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    (file,) = body["files"]
    return {
        "id": file["fileId"],
        "resource_id": "agent_shared123",
        "name": "notes.txt",
        "storage_session_id": body["storage_session_id"],
        "kind": "agent",
    }


def test_librechat_tenants_are_walls(serve: Serve, driver: Driver) -> None:
    """One LibreChat, two tenants: tenant one's agent file is primed for tenant one's
    users (the agent's files are shared within its tenant) and answers tenant two's
    users, naming the same agent id, exactly as a missing file does: on the file routes
    and in an exec's ``files``. Before, every token's tenant was one namespace."""
    ref = _upload_agent_file(serve, minted("owner", tenant_id="tenant-one"))
    missing = {**ref, "id": "m" * 21}
    session, file_id = ref["storage_session_id"], ref["id"]
    query = {"kind": "agent", "id": "agent_shared123"}

    colleague = minted("colleague", tenant_id="tenant-one")
    run = driver.invoke(
        params={"baseUrl": serve.base, "authHeaders": {"Authorization": f"Bearer {colleague}"}},
        args={"lang": "py", "code": "print(open('/mnt/data/notes.txt').read())"},
        _injected_files=[ref],
    )
    assert run["ok"], run
    assert "tenant one's notes" in run["content"], run

    stranger = minted("stranger", tenant_id="tenant-two")
    with serve.client(None, Authorization=f"Bearer {stranger}") as other:
        for route in (f"/download/{session}/{{}}", f"/sessions/{session}/objects/{{}}"):
            theirs = other.get(route.format(file_id), params=query)
            absent = other.get(route.format(missing["id"]), params=query)
            assert (theirs.status_code, theirs.content) == (404, absent.content), route
        assert other.get(f"/files/{session}", params=query).json() == []
        # A delete answers alike and removes nothing.
        assert other.delete(f"/files/{session}/{file_id}", params=query).status_code == 204

    answers = [
        driver.invoke(
            params={"baseUrl": serve.base, "authHeaders": {"Authorization": f"Bearer {stranger}"}},
            args={"lang": "py", "code": "print(open('/mnt/data/notes.txt').read())"},
            _injected_files=[item],
        )
        for item in (ref, missing)
    ]
    assert [a["ok"] for a in answers] == [False, False], answers
    assert answers[0]["error"] == answers[1]["error"], answers
    assert "rejected" in answers[0]["error"], answers

    # Tenant one still has it, whole.
    with serve.client(None, Authorization=f"Bearer {colleague}") as mine:
        got = mine.get(f"/download/{session}/{file_id}", params=query)
    assert (got.status_code, got.content) == (200, b"tenant one's notes")


def test_the_single_tenant_keeps_its_files_where_they_were(serve: Serve) -> None:
    """LibreChat's single tenant (``tenant_id: legacy``) and a token with no tenant are one
    namespace: a deployment whose LibreChat starts signing ``tenant_id`` keeps its files."""
    ref = _upload_agent_file(serve, token(sub="before"))
    query = {"kind": "agent", "id": "agent_shared123"}
    where = f"/download/{ref['storage_session_id']}/{ref['id']}"
    with serve.client(None, Authorization=f"Bearer {minted('after', tenant_id='legacy')}") as c:
        assert c.get(where, params=query).content == b"tenant one's notes"
