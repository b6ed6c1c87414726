"""A LibreChat ``/exec`` whose caller leaves takes its run with it, as ``/v1/exec`` does.

LibreChat's client gives up on a call (its own timeout, a closed chat) by closing the
connection; nobody reads that answer, so the job is stopped rather than left to run
to its time limit (280 s here) holding a run slot, and the outputs it wrote are not
kept. The call is sent on a raw socket so that the test decides when the client goes.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from urllib.parse import urlsplit

import psutil

from .conftest import KEY_A, Serve
from .test_failed_runs import _stored_with, _wait_for

_GONE_WITHIN_S = 60.0
"""A bound on the job's stop after its caller left (the job itself would sleep 600 s
under a 280 s limit), not a timing."""


def _send_exec(serve: Serve, body: dict[str, object]) -> socket.socket:
    url = urlsplit(serve.url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=30)
    head = (
        "POST /librechat/v1/exec HTTP/1.1\r\n"
        f"Host: {url.netloc}\r\n"
        f"X-API-Key: {KEY_A}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n"
        "\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _gone(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.TimeoutExpired):
        process.wait(timeout=_GONE_WITHIN_S)
        return True
    return False


def test_a_caller_that_leaves_stops_its_job_and_keeps_no_output(serve: Serve) -> None:
    content = f"left-output-{uuid.uuid4().hex}"
    marker = f"sandcell-left-{uuid.uuid4().hex[:12]}"
    code = (
        "import subprocess, sys\n"
        f"open('/mnt/data/left.txt', 'w').write({content!r})\n"
        f"subprocess.run([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\n"
    )
    sock = _send_exec(serve, {"lang": "py", "code": code, "timeout": 280_000})
    try:
        sleeper = _wait_for(marker)
    finally:
        sock.close()
    assert _gone(sleeper), "the job ran on after its caller left"
    # The run slot is free again (one run at a time per tenant here) and the tenant's
    # next call answers; the left run's output was kept by no answer.
    with serve.client() as client:
        for _ in range(600):
            answer = client.post("/exec", json={"lang": "py", "code": "print('next')"})
            if answer.status_code != 429:
                break
            time.sleep(0.1)
    assert answer.status_code == 200, answer.text
    assert answer.json()["stdout"] == "next\n"
    assert _stored_with(serve.home / "inputs", content) == []
