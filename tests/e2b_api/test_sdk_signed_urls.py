"""Signed file URLs: the SDK's ``download_url`` / ``upload_url``, fetched with no token.

The SDK signs ``path:operation:username:envdAccessToken[:expiration]`` (e2b's
``get_signature``) into a ``https://49983-<id>.<domain>/files?…`` URL; a plain HTTP
client (here httpx through the test's TLS front, with no auth header at all) reads or
writes that one file. What E2B's envd refuses is refused: a tampered signature,
another path, operation, user or sandbox, an expired URL, a wrong token header.
"""

from __future__ import annotations

import logging
import ssl
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, get_signature

from sandcell_orchestrator.e2b.errors import E2bError
from sandcell_orchestrator.e2b.signing import (
    ACCESS_LOG_SECRET_PARAMETERS,
    file_signature,
    sign_file,
)
from sandcell_orchestrator.e2b.wire import SandboxCreated, SandboxDetail
from sandcell_orchestrator.serve.redaction import RedactQueryParameters
from tests.e2b_api.conftest import DOMAIN, KEY_A, E2bServe
from tests.e2b_api.tls_front import tls_front

REFUSED = 502
"""A signature that does not match answers as a wrong token: E2B's proxy's 502."""


@dataclass
class Signed:
    """One sandbox, seen by the SDK twice: path-routed (``sdk``, for its own file calls)
    and in the E2B_DOMAIN form (``domain``, whose URLs name the sandbox's host)."""

    sdk: Sandbox
    domain: Sandbox
    client: httpx.Client

    @property
    def token(self) -> str:
        token = self.sdk._envd_access_token
        assert token
        return token

    def files_url(self, **query: str) -> str:
        """A ``/files`` URL of this sandbox with exactly ``query``."""
        base = self.domain.download_url("x").split("?", 1)[0]
        return f"{base}?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}"


@dataclass
class Front:
    """A TLS terminator in front of sandcell serve (as wildcard DNS plus Caddy would be),
    and a plain httpx client through it that sends no header of ours."""

    proxy: str
    context: ssl.SSLContext
    client: httpx.Client


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, e2b_serve: E2bServe) -> Iterator[Front]:
    directory = tmp_path_factory.mktemp("front")
    with tls_front(directory, domain=DOMAIN, upstream_port=e2b_serve.port) as (proxy, ca):
        context = ssl.create_default_context(cafile=str(ca))
        with httpx.Client(proxy=proxy, verify=context, timeout=60) as client:
            yield Front(proxy, context, client)


def _domain_form(sandbox_id: str, serve: E2bServe) -> Sandbox:
    # The control plane path-routed, the sandbox's URLs in the E2B_DOMAIN form.
    return Sandbox.connect(
        sandbox_id, api_key=KEY_A, api_url=f"{serve.url}/e2b", domain=DOMAIN, sandbox_url=None
    )


@pytest.fixture(scope="module")
def signed(e2b_serve: E2bServe, front: Front) -> Iterator[Signed]:
    sandbox = Sandbox.create(**e2b_serve.opts())
    try:
        domain = _domain_form(sandbox.sandbox_id, e2b_serve)
        assert domain.download_url("a").startswith(f"https://49983-{sandbox.sandbox_id}.{DOMAIN}/")
        yield Signed(sandbox, domain, front.client)
    finally:
        sandbox.kill()


def _multipart(data: bytes) -> dict[str, Any]:
    return {"files": {"file": ("upload.bin", data)}}


def test_download_url_reads_the_file_with_no_auth_header(
    signed: Signed, e2b_serve: E2bServe
) -> None:
    """``download_url(path)``, fetched by a plain client, answers the file's bytes, for a
    relative path and an absolute one, with and without an expiration in the future;
    path-routed, the same query with the sandbox named in ``E2b-Sandbox-Id``."""
    signed.sdk.files.write("signed/down.bin", b"\x00signed bytes\xff")
    for path in ("signed/down.bin", "/home/user/signed/down.bin"):
        for url in (
            signed.domain.download_url(path),
            signed.domain.download_url(path, use_signature_expiration=120),
        ):
            assert "signature=v1_" in url
            answer = signed.client.get(url)
            assert answer.status_code == 200, answer.text
            assert answer.content == b"\x00signed bytes\xff"
    # Signed for a user: the URL carries it, and reads as that user.
    answer = signed.client.get(signed.domain.download_url("signed/down.bin", user="root"))
    assert answer.status_code == 200, answer.text
    query = urllib.parse.urlsplit(signed.domain.download_url("signed/down.bin")).query
    answer = httpx.get(
        f"{e2b_serve.url}/e2b/sandbox/files?{query}",
        headers={"E2b-Sandbox-Id": signed.sdk.sandbox_id},
        timeout=60,
    )
    assert (answer.status_code, answer.content) == (200, b"\x00signed bytes\xff")


def test_upload_url_writes_the_file(signed: Signed) -> None:
    """``upload_url(path)`` takes a multipart POST (no header of ours) and writes the file,
    which the SDK then reads back; an expiring one too."""
    url = signed.domain.upload_url("signed/up.txt")
    answer = signed.client.post(url, **_multipart(b"uploaded by url"))
    assert answer.status_code == 200, answer.text
    assert answer.json()[0]["path"] == "/home/user/signed/up.txt"
    assert signed.sdk.files.read("signed/up.txt") == "uploaded by url"

    url = signed.domain.upload_url("/home/user/signed/up2.txt", use_signature_expiration=60)
    answer = signed.client.post(url, **_multipart(b"second"))
    assert answer.status_code == 200, answer.text
    assert signed.sdk.files.read("signed/up2.txt") == "second"
    # A raw body as well (envd takes both), with the same URL.
    answer = signed.client.post(
        url, content=b"raw", headers={"Content-Type": "application/octet-stream"}
    )
    assert answer.status_code == 200, answer.text
    assert signed.sdk.files.read("signed/up2.txt") == "raw"


def test_an_expired_url_is_refused(signed: Signed) -> None:
    """A signature that matches but whose expiration has passed is envd's 401; one whose
    expiration was changed after signing no longer matches."""
    signed.sdk.files.write("signed/exp.txt", "expiring")
    fresh = signed.domain.download_url("signed/exp.txt", use_signature_expiration=60)
    assert signed.client.get(fresh).status_code == 200

    past = get_signature("signed/exp.txt", "read", None, signed.token, -5)
    assert past["expiration"] is not None
    assert past["expiration"] < time.time()
    url = signed.files_url(
        path="signed/exp.txt",
        signature=past["signature"],
        signature_expiration=str(past["expiration"]),
    )
    answer = signed.client.get(url)
    assert answer.status_code == 401, answer.text
    assert answer.json()["message"] == "signature is already expired"

    # The fresh URL's signature with a later expiration than it was signed for.
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(fresh).query))
    query["signature_expiration"] = str(int(query["signature_expiration"]) + 3600)
    assert signed.client.get(signed.files_url(**query)).status_code == REFUSED
    # An expiring signature without its expiration: not the string that was signed.
    del query["signature_expiration"]
    assert signed.client.get(signed.files_url(**query)).status_code == REFUSED
    past_up = get_signature("signed/new.txt", "write", None, signed.token, -5)
    url = signed.files_url(
        path="signed/new.txt",
        signature=past_up["signature"],
        signature_expiration=str(past_up["expiration"]),
    )
    assert signed.client.post(url, **_multipart(b"late")).status_code == 401
    assert not signed.sdk.files.exists("signed/new.txt")


def test_a_signature_covers_one_path_operation_user_and_sandbox(
    signed: Signed, e2b_serve: E2bServe
) -> None:
    """A tampered signature, another path, the read signature on an upload, another
    user, another sandbox, a wrong token header beside a good signature, and no
    credential at all: each answers as a missing sandbox, and nothing is written."""
    signed.sdk.files.write("signed/one.txt", "one")
    signed.sdk.files.write("signed/two.txt", "two")
    good = signed.domain.download_url("signed/one.txt")
    assert signed.client.get(good).text == "one"
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(good).query))

    tampered = query["signature"][:-2] + ("AA" if query["signature"][-2:] != "AA" else "BB")
    refused = {
        "tampered": signed.files_url(**{**query, "signature": tampered}),
        "another path": signed.files_url(**{**query, "path": "signed/two.txt"}),
        "another user": signed.files_url(**{**query, "username": "root"}),
        "no signature": signed.files_url(path="signed/one.txt"),
        "empty signature": signed.files_url(path="signed/one.txt", signature=""),
    }
    for name, url in refused.items():
        answer = signed.client.get(url)
        assert answer.status_code == REFUSED, (name, answer.text)
        assert "one" not in answer.text
    # A token header, when sent, decides alone (as envd): a wrong one refuses a good URL,
    # the right one needs no signature.
    assert signed.client.get(good, headers={"X-Access-Token": "wrong"}).status_code == REFUSED
    by_token = signed.client.get(
        signed.files_url(path="signed/one.txt"), headers={"X-Access-Token": signed.token}
    )
    assert by_token.text == "one"

    # The read signature does not write; a write signature does not read.
    assert signed.client.post(good, **_multipart(b"overwritten")).status_code == REFUSED
    upload = signed.domain.upload_url("signed/one.txt")
    assert signed.client.get(upload).status_code == REFUSED
    # Signed for root, sent without the user: not what was signed.
    as_root = signed.domain.upload_url("signed/one.txt", user="root")
    root_query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(as_root).query))
    del root_query["username"]
    no_user = signed.files_url(**root_query)
    assert signed.client.post(no_user, **_multipart(b"overwritten")).status_code == REFUSED
    assert signed.sdk.files.read("signed/one.txt") == "one"

    # Another sandbox of the same tenant: this one's signed URL does not open it.
    other = Sandbox.create(**e2b_serve.opts())
    try:
        other.files.write("signed/one.txt", "other's")
        elsewhere = good.replace(signed.sdk.sandbox_id, other.sandbox_id)
        assert elsewhere != good
        answer = signed.client.get(elsewhere)
        assert answer.status_code == REFUSED
        assert "other" not in answer.text
        # ... and answers exactly as a sandbox that does not exist.
        missing = signed.client.get(good.replace(signed.sdk.sandbox_id, "m" * 20))
        assert missing.status_code == REFUSED
        assert missing.json()["error_code"] == answer.json()["error_code"]
        up = signed.domain.upload_url("signed/one.txt")
        up_elsewhere = up.replace(signed.sdk.sandbox_id, other.sandbox_id)
        assert signed.client.post(up_elsewhere, **_multipart(b"x")).status_code == REFUSED
        assert other.files.read("signed/one.txt") == "other's"
    finally:
        other.kill()


def test_a_signed_upload_writes_only_its_path(signed: Signed) -> None:
    """The ``path`` signed is the one file an upload URL writes: a multipart body with
    several files is refused (as envd refuses several parts for one path)."""
    url = signed.domain.upload_url("signed/only.txt")
    answer = signed.client.post(
        url,
        files=[("file", ("signed/a.txt", b"a")), ("file", ("signed/b.txt", b"b"))],
    )
    assert answer.status_code == 400, answer.text
    assert not signed.sdk.files.exists("signed/a.txt")
    assert not signed.sdk.files.exists("signed/b.txt")
    assert signed.client.post(url, **_multipart(b"one")).status_code == 200
    assert signed.sdk.files.read("signed/only.txt") == "one"


def test_no_signature_reaches_the_log(signed: Signed, e2b_serve: E2bServe) -> None:
    """The access log records signed requests with the signature redacted."""
    signed.sdk.files.write("signed/log.txt", "logged")
    url = signed.domain.download_url("signed/log.txt", use_signature_expiration=60)
    assert signed.client.get(url).status_code == 200
    signature = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))["signature"]
    deadline = time.monotonic() + 10
    while "/files?path=signed%2Flog.txt" not in (log := e2b_serve.log()):
        assert time.monotonic() < deadline, "the access log has no line for the request"
        time.sleep(0.05)
    assert "signature=[redacted]" in log
    assert signature not in log
    assert signature.removeprefix("v1_") not in log
    assert urllib.parse.quote(signature, safe="") not in log


def test_an_encoded_signature_name_is_redacted_too(signed: Signed, e2b_serve: E2bServe) -> None:
    """``%73ignature=`` is read as the signature (the file is served), so the access log
    redacts it as one; it used to keep the line as sent, signature and all."""
    signed.sdk.files.write("signed/encoded.txt", "encoded")
    url = signed.domain.download_url("signed/encoded.txt")
    signature = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))["signature"]
    encoded = url.replace("&signature=", "&%73ignature=")
    assert encoded != url
    answer = signed.client.get(encoded)
    assert (answer.status_code, answer.text) == (200, "encoded")
    deadline = time.monotonic() + 10
    while "/files?path=signed%2Fencoded.txt" not in (log := e2b_serve.log()):
        assert time.monotonic() < deadline, "the access log has no line for the request"
        time.sleep(0.05)
    assert "%73ignature=[redacted]" in log
    assert urllib.parse.quote(signature, safe="") not in log
    assert signature.removeprefix("v1_") not in log


async def test_the_async_sdk_hands_out_the_same_urls(e2b_serve: E2bServe, front: Front) -> None:
    """``AsyncSandbox.download_url`` / ``upload_url``: the same signatures, served alike."""
    sandbox = await AsyncSandbox.create(**e2b_serve.opts())
    try:
        domain = await AsyncSandbox.connect(
            sandbox.sandbox_id,
            api_key=KEY_A,
            api_url=f"{e2b_serve.url}/e2b",
            domain=DOMAIN,
            sandbox_url=None,
        )
        up = domain.upload_url("async.txt", use_signature_expiration=60)
        async with httpx.AsyncClient(proxy=front.proxy, verify=front.context, timeout=60) as client:
            answer = await client.post(up, **_multipart(b"async upload"))
            assert answer.status_code == 200, answer.text
            assert await sandbox.files.read("async.txt") == "async upload"
            answer = await client.get(domain.download_url("async.txt"))
            assert (answer.status_code, answer.content) == (200, b"async upload")
            assert (await client.get(up)).status_code == REFUSED
    finally:
        await sandbox.kill()


# -- the signature itself ---------------------------------------------------------------


def test_sandcell_signs_as_the_sdk_does() -> None:
    """``sign_file`` is e2b's ``get_signature``, with and without user and expiration."""
    token = "tok-" + "a" * 39
    for user in (None, "user", "root"):
        plain = get_signature("/home/user/a b.txt", "read", user, token)
        assert plain["expiration"] is None
        assert plain["signature"] == sign_file(
            path="/home/user/a b.txt",
            operation="read",
            username=user or "",
            token=token,
            expiration_s=None,
        )
        timed = get_signature("x.txt", "write", user, token, 30)
        assert timed["signature"] == sign_file(
            path="x.txt",
            operation="write",
            username=user or "",
            token=token,
            expiration_s=timed["expiration"],
        )


def test_what_a_request_claims() -> None:
    """GET claims ``read``, POST ``write``, an absent user is ``""``; other methods and
    unsigned requests claim nothing; a malformed expiration or no path is a 400."""
    claim = file_signature("GET", {"path": "a", "signature": "v1_x"})
    assert claim is not None
    assert (claim.operation, claim.username, claim.expiration_s) == ("read", "", None)
    claim = file_signature(
        "POST", {"path": "a", "signature": "v1_x", "username": "root", "signature_expiration": "7"}
    )
    assert claim is not None
    assert (claim.operation, claim.username, claim.expiration_s) == ("write", "root", 7)
    assert file_signature("PUT", {"path": "a", "signature": "v1_x"}) is None
    assert file_signature("GET", {"path": "a"}) is None
    for bad in ({"signature_expiration": "soon"}, {"signature_expiration": "1_0"}, {"path": ""}):
        with pytest.raises(E2bError) as raised:
            file_signature("GET", {"path": "a", "signature": "v1_x", **bad})
        assert raised.value.status == 400


def test_reprs_leave_the_credentials_out() -> None:
    """A signed request's claim and the answers that carry a sandbox's tokens: a log
    line or a traceback that formats one shows no credential."""
    claim = file_signature("GET", {"path": "a", "signature": "v1_SECRET"})
    assert claim is not None
    assert "SECRET" not in repr(claim)
    assert "path='a'" in repr(claim)
    common = {"templateID": "base", "sandboxID": "s" * 20, "clientID": "c", "envdVersion": "1"}
    created = SandboxCreated(**common, envdAccessToken="SECRET", trafficAccessToken="SECRET")
    detail = SandboxDetail(
        **common,
        startedAt="t",
        endAt="t",
        cpuCount=1,
        memoryMB=0,
        diskSizeMB=0,
        state="running",
        envdAccessToken="SECRET",
    )
    for answer in (created, detail):
        assert "SECRET" not in repr(answer)
        assert "s" * 20 in repr(answer)


def test_access_log_lines_lose_their_signature() -> None:
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        (
            "127.0.0.1:1",
            "GET",
            "/files?path=a&signature=v1_SECRET%2Bx&signature_expiration=9",
            "1.1",
            200,
        ),
        None,
    )
    assert RedactQueryParameters(ACCESS_LOG_SECRET_PARAMETERS).filter(record)
    assert "SECRET" not in record.getMessage()
    assert "/files?path=a&signature=[redacted]&signature_expiration=9" in record.getMessage()
