"""The runner's token is out of every child's reach (issue 14, item 6): real runners.

Given in ``SANDCELL_RUNNER_TOKEN``, the runner execs itself again without it (same
pid), so ``/proc/<runner>/environ`` never shows it; given in
``SANDCELL_RUNNER_TOKEN_FILE``, the file is read and unlinked. The runner is
non-dumpable and a root warmup command runs without ``CAP_SYS_PTRACE``: it reads
neither the runner's environment, nor its memory, nor its descriptors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidHandshake
from websockets.sync.client import connect

from sandcell_runner.runner_token import TokenSourceError, read_token_file, take_token_file
from sandcell_runner.warmup import warmup_argv
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, start_runner
from tests.runner.conftest import StartRunner
from tests.runner.helpers import execute

# Run by the warmup command (as the runner's child, root here): everything it can
# learn of its parent goes to the file named by $1, and memory says whether it read.
PROBE = r"""
import os, sys
out = open(sys.argv[1], "w")
ppid = os.getppid()
for name in ("environ", "cmdline"):
    try:
        out.write(name + ":" + open(f"/proc/{ppid}/{name}", "rb").read().decode("latin-1") + "\n")
    except OSError as exc:
        out.write(f"{name}:denied {exc.errno}\n")
try:
    fds = os.listdir(f"/proc/{ppid}/fd")
except OSError as exc:
    out.write(f"fd:denied {exc.errno}\n")
else:
    for fd in fds:
        try:
            handle = os.open(f"/proc/{ppid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            out.write("fd:" + os.read(handle, 4096).decode("latin-1") + "\n")
        except OSError:
            pass
        finally:
            os.close(handle)
try:
    with open(f"/proc/{ppid}/maps") as maps, open(f"/proc/{ppid}/mem", "rb") as mem:
        start = int(maps.readline().split("-")[0], 16)
        mem.seek(start)
        mem.read(16)
    out.write("mem:read\n")
except OSError as exc:
    out.write(f"mem:denied {exc.errno}\n")
out.close()
"""


def _wait_warmup(runner: RunnerProcess) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        health = httpx.get(runner.url + "/health", headers=runner.headers(), timeout=5)
        if health.json()["warmup"] in ("done", "failed"):
            return
        time.sleep(0.05)
    raise AssertionError("warmup never ended")


def _environ_of(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_a_token_from_the_environment_leaves_no_trace_a_warmup_can_read(
    runner_factory: StartRunner, tmp_path: Path
) -> None:
    """Warmup (root, unjailed) reads neither environ, cmdline, fds nor memory of the runner."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    found = tmp_path / "found.txt"
    runner = runner_factory(
        SANDCELL_RUNNER_WARMUP_COMMAND=f"exec {sys.executable} {probe} {found}",
    )
    _wait_warmup(runner)
    seen = found.read_text()
    assert runner.token not in seen
    assert "mem:read" not in seen, seen
    # Same pid (exec, not a child), and its environment block is clean.
    assert runner.token.encode() not in _environ_of(runner.process.pid)
    assert b"SANDCELL_RUNNER_TOKEN=" not in _environ_of(runner.process.pid)
    assert execute(runner, language="sh", code="echo authed")["stdout"] == "authed\n"


def test_a_token_file_is_read_and_unlinked() -> None:
    """SANDCELL_RUNNER_TOKEN_FILE: the runner authenticates with its token, the file is gone."""
    with traversable_dir() as root:
        token_file = root / "token"
        runner = start_runner(root / "runner", token_file=token_file)
        try:
            assert not token_file.exists()
            assert runner.token.encode() not in _environ_of(runner.process.pid)
            assert execute(runner, language="sh", code="echo ok")["stdout"] == "ok\n"
            wrong = httpx.post(
                runner.url + "/v1/execute",
                json={"language": "sh", "code": "true"},
                headers={"Authorization": "Bearer " + "0" * 48},
                timeout=30,
            )
            assert wrong.status_code == 401
        finally:
            runner.stop()


def test_a_websocket_handshake_logged_at_debug_shows_no_token(
    runner_factory: StartRunner,
) -> None:
    """websockets logs every upgrade's headers at DEBUG on uvicorn's error logger; the
    runner drops those lines, so its log never holds the bearer token it was sent."""
    runner = runner_factory(SANDCELL_RUNNER_LOG_LEVEL="debug", SANDCELL_RUNNER_SESSIONS="1")
    url = runner.url.replace("http://", "ws://") + "/v1/session/ports/8000/hmr?x=1"
    headers = runner.headers(**{"X-Runtime-Session-Id": "rt_" + "a" * 64})
    with pytest.raises(InvalidHandshake), connect(url, additional_headers=headers):
        pass
    log = runner.log()
    assert '"WebSocket /v1/session/ports/8000/hmr?x=1"' in log  # the upgrade was logged
    assert runner.token not in log
    assert "authorization" not in log.lower()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        (
            {"SANDCELL_RUNNER_TOKEN": "t" * 32, "SANDCELL_RUNNER_TOKEN_FILE": "/nonexistent"},
            "not both",
        ),
        ({"SANDCELL_RUNNER_TOKEN_FILE": "/nonexistent/token"}, "SANDCELL_RUNNER_TOKEN_FILE"),
    ],
)
def test_a_bad_token_source_fails_start_up_naming_the_variable(
    env: dict[str, str], named: str
) -> None:
    with traversable_dir() as root:
        done = subprocess.run(
            [sys.executable, "-m", "sandcell_runner"],
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "SANDCELL_WORKSPACE_ROOT": str(root / "ws"),
                **env,
            },
            capture_output=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2
    assert named in done.stderr.decode()
    assert "t" * 32 not in done.stderr.decode()


def test_a_root_warmup_drops_ptrace_or_is_refused() -> None:
    """Root: through setpriv without the capabilities that read another process; no
    setpriv: refused rather than run with them. Not root: a plain shell."""
    argv = warmup_argv("true", euid=0, which=lambda _: "/usr/bin/setpriv")
    assert argv is not None
    assert argv[0] == "/usr/bin/setpriv"
    assert "--bounding-set=-sys_ptrace,-sys_rawio,-sys_module" in argv
    assert "--inh-caps=-sys_ptrace,-sys_rawio,-sys_module" in argv
    assert argv[-3:] == ["/bin/sh", "-c", "true"]
    assert warmup_argv("true", euid=0, which=lambda _: None) is None
    assert warmup_argv("true", euid=1000, which=lambda _: None) == ["/bin/sh", "-c", "true"]


def test_token_files_are_consumed(tmp_path: Path) -> None:
    """A file is unlinked once read; /dev/fd/N is read and N closed; empty is refused."""
    path = tmp_path / "token"
    path.write_text("s3cret-token-value\n")
    assert take_token_file(str(path)) == "s3cret-token-value"
    assert not path.exists()
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"piped-token-value")
    os.close(write_fd)
    assert take_token_file(f"/dev/fd/{read_fd}") == "piped-token-value"
    with pytest.raises(OSError):
        os.fstat(read_fd)  # closed
    path.write_text("")
    with pytest.raises(TokenSourceError, match="empty"):
        take_token_file(str(path))
    kept = tmp_path / "kept"
    kept.write_text("left-in-place-token")
    assert read_token_file(str(kept)) == "left-in-place-token"
    assert kept.exists()
