"""A runner serving a listening socket it inherited (``SANDCELL_RUNNER_LISTEN_FD``)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.fixtures.paths import traversable_dir


def _env(root: Path, token: str, **extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SANDCELL_RUNNER_TOKEN": token,
        "SANDCELL_WORKSPACE_ROOT": str(root / "ws"),
        "SANDCELL_INPUT_CACHE_DIR": str(root / "ic"),
        "SANDCELL_RUNNER_REAP_INTERVAL_S": "3600",
        **extra,
    }


@pytest.fixture
def root() -> Iterator[Path]:
    with traversable_dir() as path:
        yield path


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def test_a_request_queued_before_start_up_is_answered(root: Path) -> None:
    token = secrets.token_hex(24)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    inode = f"socket:[{os.fstat(listener.fileno()).st_ino}]"
    # Connected and sent before the runner exists: it waits in the backlog.
    early = socket.create_connection(("127.0.0.1", port), timeout=60)
    early.sendall(b"GET /health HTTP/1.1\r\nHost: runner\r\nConnection: close\r\n\r\n")
    env = _env(root, token, SANDCELL_RUNNER_LISTEN_FD=str(listener.fileno()))
    with (root / "runner.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sandcell_runner"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(listener.fileno(),),
        )
    listener.close()
    try:
        answer = b""
        while chunk := early.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        early.close()
        headers = {"Authorization": f"Bearer {token}"}
        url = f"http://127.0.0.1:{port}"
        done = httpx.post(
            url + "/v1/execute",
            json={"language": "bash", "code": "echo hi"},
            headers=headers,
            timeout=60,
        )
        assert done.status_code == 200, done.text
        assert done.json()["exit_code"] == 0
        # The runner's own copy of the listener is not handed to any process it starts.
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "the runner starts helpers (spawn helper, extractor server)"
        for child in children:
            assert inode not in _socket_inodes(child.pid), child.cmdline()
    finally:
        process.terminate()
        process.wait(timeout=30)
    # Its exit closed the only listener: nothing is left accepting on the port.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.parametrize("kind", ["pipe", "unlistened socket"])
def test_a_listen_fd_that_is_no_listener_fails_start_up_naming_the_variable(
    root: Path, kind: str
) -> None:
    if kind == "pipe":
        read_fd, write_fd = os.pipe()
        fd, keep = read_fd, [read_fd, write_fd]
    else:
        sock = socket.socket()
        fd, keep = sock.fileno(), [sock.detach()]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "sandcell_runner"],
            env=_env(root, secrets.token_hex(24), SANDCELL_RUNNER_LISTEN_FD=str(fd)),
            capture_output=True,
            timeout=60,
            check=False,
            pass_fds=(fd,),
        )
    finally:
        for each in keep:
            os.close(each)
    assert done.returncode == 2, done.stderr.decode()[-500:]
    assert "SANDCELL_RUNNER_LISTEN_FD" in done.stderr.decode()


def test_a_listen_fd_below_three_is_refused(root: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sandcell_runner"],
        env=_env(root, secrets.token_hex(24), SANDCELL_RUNNER_LISTEN_FD="1"),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "SANDCELL_RUNNER_LISTEN_FD" in done.stderr.decode()
