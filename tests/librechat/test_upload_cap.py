"""Uploads past ``SANDCELL_LIBRECHAT_MAX_UPLOAD_BYTES`` (1 MiB for this module's serve).

LibreChat's server uploads with axios (``crud.js``) and logs the answer's body when
an upload fails: the 413 says which limit and which variable sets it. A body that
declares no length (chunked) is cut off at the cap as it streams, not read whole
first: the 413 comes while the client is still sending.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.librechat.conftest import KEY_A, Serve, running_serve

CAP = 1 << 20
BOUNDARY = "sandcellcapboundary"
TOO_LARGE = {
    "error": "payload_too_large",
    "message": (
        f"the upload is larger than {CAP} bytes, the limit SANDCELL_LIBRECHAT_MAX_UPLOAD_BYTES sets"
    ),
}


@pytest.fixture(scope="module")
def capped() -> Iterator[Serve]:
    with running_serve("lc-cap-", SANDCELL_LIBRECHAT_MAX_UPLOAD_BYTES=str(CAP)) as running:
        yield running


def part_head(name: str) -> bytes:
    return (
        f"--{BOUNDARY}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{name}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_a_declared_length_past_the_cap_is_a_413_that_names_it(capped: Serve) -> None:
    """Refused before a byte of the body is read, with the limit and its variable in
    the message (it was empty)."""
    with capped.client(KEY_A, **{"User-Id": "user-1"}) as client:
        answer = client.post("/upload", files=[("file", ("big.bin", b"x" * (CAP + 1)))])
    assert answer.status_code == 413
    assert answer.json() == TOO_LARGE


def test_a_chunked_body_is_cut_off_at_the_cap_while_it_streams(capped: Serve) -> None:
    """A chunked upload that passes the cap is answered 413 as soon as it does: the client
    has sent a little past the cap and not ended the body (no last chunk), and the answer
    comes anyway (the whole body was read before the cap was applied, so this waited for
    an end that never came)."""
    address = urlsplit(capped.url)
    assert address.hostname is not None
    assert address.port is not None
    head = (
        "POST /librechat/v1/upload HTTP/1.1\r\n"
        f"Host: {address.hostname}:{address.port}\r\n"
        f"X-API-Key: {KEY_A}\r\n"
        "User-Id: user-1\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    with socket.create_connection((address.hostname, address.port)) as conn:
        # A hang guard only: the answer is asserted, never how soon it came.
        conn.settimeout(120)
        conn.sendall(head + chunk(part_head("big.bin")))
        piece = b"y" * (64 << 10)
        for _ in range(CAP // len(piece) + 1):
            conn.sendall(chunk(piece))
        status, body = read_response(conn)
    assert status == 413
    assert httpx.Response(413, content=body).json() == TOO_LARGE


def test_a_chunked_body_under_the_cap_is_kept_whole(capped: Serve) -> None:
    """The cut-off counts only: a chunked upload under the cap is kept and downloads."""
    data = bytes(range(256)) * 1024
    body = part_head("whole.bin") + data + f"\r\n--{BOUNDARY}--\r\n".encode()
    pieces = [body[i : i + 10_000] for i in range(0, len(body), 10_000)]
    headers = {"User-Id": "user-1", "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    with capped.client(KEY_A, **headers) as client:
        answer = client.post("/upload", content=iter(pieces))
        assert answer.status_code == 200, answer.text
        got = answer.json()
        session, file_id = got["session_id"], got["files"][0]["fileId"]
        assert client.get(f"/download/{session}/{file_id}").content == data


def read_response(conn: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 answer with a Content-Length off ``conn``: its status and body."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        received = conn.recv(65536)
        assert received, f"the connection closed before an answer: {buffer!r}"
        buffer += received
    head, _, body = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")
    )
    while len(body) < length:
        received = conn.recv(65536)
        assert received, "the connection closed inside the answer"
        body += received
    return status, body[:length]


def test_an_exec_body_past_its_limit_is_a_413_that_names_it(capped: Serve) -> None:
    """``/exec`` and ``/exec/programmatic`` bodies past 32 MiB are 413 with the limit in the
    message (it was empty)."""
    body = b" " * ((32 << 20) + 1)
    expected = {
        "error": "payload_too_large",
        "message": f"the request body is larger than {32 << 20} bytes",
    }
    with capped.client(KEY_A, **{"Content-Type": "application/json"}) as client:
        for route in ("/exec", "/exec/programmatic"):
            answer = client.post(route, content=body)
            assert answer.status_code == 413, route
            assert answer.json() == expected, route
