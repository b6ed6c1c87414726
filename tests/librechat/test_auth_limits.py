"""LibreChat's signed tokens, the per-tenant concurrency limit and the run timeout,
through the real client against a real serve."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.errors import SecurityWarning
from joserfc.jwk import OKPKey

from sandcell_orchestrator.serve.errors import MAX_BODY_BYTES
from sandcell_orchestrator.serve.librechat.exec_routes import BODY_KEY_MAX_BYTES
from tests.librechat.conftest import ED_KEY, KEY_A, RSA_KEY, Driver, Serve, running_serve

STRANGER = OKPKey.generate_key("Ed25519")


def token(key: Any = ED_KEY, alg: str = "EdDSA", **claims: Any) -> str:
    now = int(time.time())
    body = {"iss": "librechat", "aud": "codeapi", "sub": "jwt-user", "iat": now, "exp": now + 60}
    with warnings.catch_warnings():
        # joserfc flags "EdDSA" (RFC 9864 prefers "Ed25519"); it is what LibreChat signs with.
        warnings.simplefilter("ignore", SecurityWarning)
        return jwt.encode({"alg": alg}, {**body, **claims}, key, algorithms=[alg])


def run_as(driver: Driver, serve: Serve, bearer: str, code: str = "print('hi')") -> dict[str, Any]:
    return driver.invoke(
        params={"baseUrl": serve.base, "authHeaders": {"Authorization": f"Bearer {bearer}"}},
        args={"lang": "py", "code": code},
    )


def test_librechat_tokens_are_verified(serve: Serve, driver: Driver) -> None:
    """EdDSA and RS256 tokens from the configured keys are accepted, and the token's user
    owns what the run produced; expired, wrong-audience or -issuer, over-long, unknown-key
    and unsigned tokens are 401 ("not authorized")."""
    ok = run_as(driver, serve, token(), "open('mine.txt', 'w').write('jwt')")
    assert ok["ok"], ok
    produced = ok["artifact"]["files"][0]
    where = f"/download/{produced['storage_session_id']}/{produced['id']}"
    with serve.client(None, Authorization=f"Bearer {token()}") as owner:
        assert owner.get(where).content == b"jwt"
    with serve.client(None, Authorization=f"Bearer {token(sub='someone-else')}") as other:
        assert other.get(where).status_code == 404

    rsa = run_as(driver, serve, token(RSA_KEY, "RS256"))
    assert rsa["ok"], rsa
    now = int(time.time())
    for bad in (
        token(iat=now - 200, exp=now - 100),  # past even the clock-skew leeway
        token(aud="something-else"),
        token(iss="not-librechat"),
        token(iat=now, exp=now + 301),
        token(STRANGER),
        token().rsplit(".", 1)[0] + ".",
    ):
        refused = run_as(driver, serve, bad)
        assert not refused["ok"]
        assert "not authorized" in refused["error"], refused
    with httpx.Client(base_url=serve.base) as anonymous:
        assert anonymous.post("/exec", json={"lang": "py", "code": "1"}).status_code == 401


def test_a_tenant_past_its_concurrency_is_rate_limited_and_a_long_run_times_out(
    serve: Serve, driver: Driver
) -> None:
    """With SANDCELL_LIBRECHAT_MAX_CONCURRENT=1 a second run while one is in flight is
    429 rate_limited with retry_after_seconds; a run past its timeout is 504."""
    started = threading.Event()
    results: dict[str, httpx.Response] = {}

    def long_run() -> None:
        with serve.client() as client:
            started.set()
            results["long"] = client.post(
                "/exec", json={"lang": "py", "code": "import time; time.sleep(60)", "timeout": 4000}
            )

    thread = threading.Thread(target=long_run)
    thread.start()
    started.wait()
    try:
        deadline = time.monotonic() + 30
        while True:
            with serve.client() as client:
                second = client.post("/exec", json={"lang": "py", "code": "print(1)"})
            if second.status_code == 429 or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # the first call has not reached its slot yet
        assert second.status_code == 429, second.text
        assert second.json()["error"] == "rate_limited"
        assert second.json()["retry_after_seconds"] >= 1
        limited = driver.invoke(
            params={"baseUrl": serve.base, "authHeaders": {"X-API-Key": KEY_A}},
            args={"lang": "py", "code": "print(1)"},
        )
        assert "rate-limited" in limited["error"], limited
    finally:
        thread.join(timeout=120)
    assert results["long"].status_code == 504, results["long"].text
    assert results["long"].json()["error"] == "execution_timeout"


def test_the_jwt_key_files_are_checked_at_start_up(tmp_path: Path) -> None:
    """A key file that is not a key stops ``sandcell serve`` with the variable's name."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    with pytest.raises(AssertionError, match="SANDCELL_LIBRECHAT_JWT_PUBLIC_KEYS"):  # noqa: SIM117
        with running_serve("lc-badkey-", SANDCELL_LIBRECHAT_JWT_PUBLIC_KEYS=str(bad)):
            pass


def test_a_token_user_cannot_run_another_users_file(serve: Serve) -> None:
    """A ref to another user's private file from a token's user is an unknown input, as
    its download is a 404: the answer for a file that does not exist; the owner runs it."""
    with serve.client(None, Authorization=f"Bearer {token(sub='alice')}") as alice:
        uploaded = alice.post(
            "/upload", data={"kind": "user", "id": "alice"}, files=[("file", ("a.txt", b"A"))]
        ).json()
    ref = {
        "id": uploaded["files"][0]["fileId"],
        "storage_session_id": uploaded["storage_session_id"],
        "name": "a.txt",
        "kind": "user",
    }
    missing = {**ref, "id": "x" * 21}
    code = {"lang": "py", "code": "print(open('a.txt').read())"}
    with serve.client(None, Authorization=f"Bearer {token(sub='mallory')}") as mallory:
        theirs = mallory.post("/exec", json={**code, "files": [ref]})
        absent = mallory.post("/exec", json={**code, "files": [missing]})
    assert theirs.status_code == absent.status_code == 400
    assert theirs.json()["error"] == absent.json()["error"] == "input_missing"
    with serve.client(None, Authorization=f"Bearer {token(sub='alice')}") as alice:
        mine = alice.post("/exec", json={**code, "files": [ref]})
    assert mine.json()["stdout"] == "A\n", mine.text


def test_idempotency_keys_are_scoped_to_the_token_user(serve: Serve) -> None:
    """Two token users of the one JWT tenant sending the same key and body each get a run
    of their own: the second never replays the first user's answer."""
    call = {"lang": "py", "code": "import os; print(os.urandom(8).hex())"}
    key = {"Idempotency-Key": "review-same-key-1"}
    answers = []
    for user in ("alice", "mallory", "alice"):
        with serve.client(None, Authorization=f"Bearer {token(sub=user)}") as client:
            answers.append(client.post("/exec", json=call, headers=key))
    first, other, again = answers
    assert first.status_code == other.status_code == again.status_code == 200
    assert "idempotent-replayed" not in other.headers
    assert other.json()["stdout"] != first.json()["stdout"]
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["stdout"] == first.json()["stdout"]


def test_a_continuation_token_is_bound_to_its_token_user(serve: Serve) -> None:
    """Another token user of the one JWT tenant presenting a continuation token gets
    ``invalid_continuation``, as for an unknown token; its owner then continues."""
    first_call = {"code": "print(await lookup(q='x'))", "tools": [{"name": "lookup"}]}
    with serve.client(None, Authorization=f"Bearer {token(sub='alice')}") as alice:
        first = alice.post("/exec/programmatic", json=first_call).json()
    assert first["status"] == "tool_call_required", first
    (call,) = first["tool_calls"]
    answer = {"call_id": call["id"], "result": '"found"', "is_error": False}
    body = {"continuation_token": first["continuation_token"], "tool_results": [answer]}
    with serve.client(None, Authorization=f"Bearer {token(sub='mallory')}") as mallory:
        stolen = mallory.post("/exec/programmatic", json=body)
    assert stolen.status_code == 400
    assert stolen.json()["error"] == "invalid_continuation"
    with serve.client(None, Authorization=f"Bearer {token(sub='alice')}") as alice:
        done = alice.post("/exec/programmatic", json=body).json()
    assert done["status"] == "completed", done
    assert "found" in done["stdout"], done


def _partial_exec(serve: Serve, headers: dict[str, str], body: bytes) -> tuple[int, str]:
    """POST /exec sending ``headers`` and only ``body`` of what they announce, then the
    answer's status and error code: an answer proves the service gave it without
    waiting for the rest of the body."""
    where = urllib.parse.urlsplit(serve.base)
    assert where.hostname is not None
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.putrequest("POST", f"{where.path}/exec")
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())["error"]
    finally:
        conn.close()


def test_an_exec_its_headers_do_not_authenticate_is_refused_before_its_body_is_parsed(
    serve: Serve,
) -> None:
    """Without a key in the headers the body is read only for a legacy key, at most
    BODY_KEY_MAX_BYTES of it: malformed JSON, an over-long declared or streamed body
    and a missing key are all 401 unauthorized (never the 400 or 413 that would say
    the body was parsed); a small body with the key authenticates."""
    with httpx.Client(base_url=serve.base, timeout=120) as anonymous:
        for content in (b"{not json", b"[1, 2]", b'{"lang": "py", "code": 1}'):
            refused = anonymous.post("/exec", content=content)
            assert refused.status_code == 401, (content, refused.text)
            assert refused.json()["error"] == "unauthorized"
        legacy = anonymous.post(
            "/exec", json={"lang": "py", "code": "print(6 * 7)", "LIBRECHAT_CODE_API_KEY": KEY_A}
        )
        assert legacy.status_code == 200, legacy.text
        assert legacy.json()["stdout"] == "42\n"
        with serve.client() as keyed:
            malformed = keyed.post("/exec", content=b"{not json")
        assert malformed.status_code == 400, malformed.text

    # A declared length past even MAX_BODY_BYTES: 401 before a byte of it is read.
    declared = {"Content-Type": "application/json", "Content-Length": str(MAX_BODY_BYTES + 1)}
    assert _partial_exec(serve, declared, b"") == (401, "unauthorized")
    # A streamed (chunked) body is cut off past BODY_KEY_MAX_BYTES, its end never sent.
    chunk = b'{"code": "' + b"x" * BODY_KEY_MAX_BYTES
    chunked = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    assert _partial_exec(serve, {"Transfer-Encoding": "chunked"}, chunked) == (401, "unauthorized")


def test_a_bad_user_id_is_400_with_or_without_a_session(serve: Serve) -> None:
    """The user is kept with the run's outputs even without a runtime session: one the
    protocol's user-id rule refuses (a NUL, a control character, over 128 characters) is
    a 400 either way (a NUL was a 200 without a hint; any length was accepted), and so
    is an upload's ``User-Id``."""
    with serve.client() as client:
        for user in ("a\x00b", "a\nb", "u" * 129, "u" * 100_000):
            for extra in ({}, {"runtime_session_hint": "nul-user"}):
                body = {"lang": "py", "code": "print(1)", "user_id": user, **extra}
                refused = client.post("/exec", json=body)
                assert (refused.status_code, refused.json()["error"]) == (400, "bad_request")
                assert "user_id" in refused.json()["message"]
                assert len(refused.content) < 1000
    upload = serve.upload([("x.txt", b"x")], user="u" * 129)
    assert (upload.status_code, upload.json()["error"]) == (400, "bad_request")
    assert "User-Id" in upload.json()["message"]
