"""What a job can and cannot do: real nsjail, real runner, real kernel checks."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from sandcell_runner.jail.cgroups import CGROUP_ROOT
from sandcell_runner.service import instance_key
from tests.fixtures.runner_process import RunnerProcess, start_runner
from tests.runner.conftest import StartRunner
from tests.runner.helpers import execute, unb64
from tests.runner.jail.real_jail import SPAWN_METHODS, helper_method


def test_fork_bomb_is_contained_and_runner_stays_healthy(runner: RunnerProcess) -> None:
    code = ":(){ :|:& };:; sleep 1"
    result = execute(runner, language="bash", code=code, limits={"pids": 32}, timeout_ms=3000)
    assert result["status"] in ("ok", "timeout", "error")
    # The pid namespace died with the job: nothing of the bomb is left on the host.
    runner_tree = psutil.Process(runner.process.pid).children(recursive=True)
    leftovers = [p for p in runner_tree if _alive(p) and p.uids().real >= 20000]
    assert not leftovers
    assert httpx.get(runner.url + "/health").json()["status"] == "ok"
    after = execute(runner, language="bash", code="echo alive")
    assert after["stdout"] == "alive\n"


def test_pids_limit_refuses_forks(runner: RunnerProcess) -> None:
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print('refused after', n, exc.errno)\n"
    )
    result = execute(runner, language="python", code=code, limits={"pids": 16}, timeout_ms=10000)
    assert "refused after" in result["stdout"], result
    assert int(result["stdout"].split()[2]) < 16


def test_network_is_cut(runner: RunnerProcess) -> None:
    """A connect to the runner's own port from inside the jail fails."""
    code = (
        "import socket\n"
        "for host in ('127.0.0.1', '10.0.2.2', '1.1.1.1'):\n"
        "    s = socket.socket(); s.settimeout(2)\n"
        "    try:\n"
        f"        s.connect((host, {runner.port})); print('CONNECTED', host)\n"
        "    except OSError as exc:\n"
        "        print('refused', host, type(exc).__name__)\n"
    )
    result = execute(runner, language="python", code=code, timeout_ms=15000)
    assert "CONNECTED" not in result["stdout"], result
    assert result["stdout"].count("refused") == 3


def test_files_are_owned_by_pool_uid_outside(runner: RunnerProcess) -> None:
    """A file the job creates is owned outside by an unprivileged pool UID, never 0."""
    code = (
        "import os, time\nopen('mine.txt', 'w').write('x')\n"
        "print(os.getuid(), flush=True)\ntime.sleep(3)"
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(execute, runner, language="python", code=code)
        found: list[Path] = []
        deadline = time.monotonic() + 10
        while not found and time.monotonic() < deadline:
            # jobs/<id>/ws (a tmpfs) or workspace-images/<n>.mnt/ws (an ext4 image)
            found = list(runner.root.glob("*/*/ws/mine.txt"))
            time.sleep(0.05)
        assert found, "job file never appeared on the host"
        st = found[0].stat()
        result = future.result()
    assert st.st_uid != 0
    assert st.st_uid >= 20000
    assert st.st_gid == st.st_uid
    assert int(result["stdout"]) == st.st_uid


def test_job_cannot_see_token_or_runner_state(runner: RunnerProcess) -> None:
    token = runner.token
    code = (
        "import os, glob\n"
        "hits = []\n"
        "if any(token in v for v in os.environ.values()): hits.append('env')\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n"
        "        if token.encode() in open(path, 'rb').read(): hits.append(path)\n"
        "    except OSError: pass\n"
        "for path in (RUNNER_ROOT, REPO, '/root', '/etc/shadow', '/etc/passwd'):\n"
        "    if os.path.exists(path): hits.append('visible:' + path)\n"
        "print(sorted(os.listdir('/')))\n"
        "print(len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
        "print(hits)\n"
    )
    code = (
        f"token = {token!r}\nRUNNER_ROOT = {str(runner.root)!r}\n"
        f"REPO = {str(Path(__file__).resolve().parents[3])!r}\n" + code
    )
    result = execute(runner, language="python", code=code)
    lines = result["stdout"].splitlines()
    assert lines[-1] == "[]", result
    # Only the job's own processes are visible: it is PID 1 of a fresh namespace.
    assert int(lines[-2]) <= 2
    assert token not in result["stdout"]


# Run in a job: what it can learn of its environment, descriptors, mounts and cgroups.
_JOB_VIEW = r"""
import json, os
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass  # the listing's own descriptor, closed already
others = {}
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    for name in ("environ", "cmdline"):
        try:
            others[f"{pid}/{name}"] = open(f"/proc/{pid}/{name}", "rb").read().decode("latin-1")
        except OSError as exc:
            others[f"{pid}/{name}"] = f"error {exc.errno}"
print(json.dumps({
    "env": dict(os.environ), "fds": fds, "procs": others,
    "mountinfo": open("/proc/self/mountinfo").read(),
    "cgroup": open("/proc/self/cgroup").read(), "sys": os.path.exists("/sys"),
}))
"""


def test_a_job_sees_only_its_own_environment_descriptors_and_mounts(
    runner: RunnerProcess,
) -> None:
    """Its environment is the documented defaults plus what the request asked for; it
    holds stdin/stdout/stderr only (no runner socket, token pipe or log file); no mount
    names the token or the runner's state beside its own workspace; /sys and the cgroup
    tree are not there. The next job does not see the first one's variables."""
    secret = "job-env-S3CR3T-0b9e"
    seen = json.loads(
        execute(runner, language="python", code=_JOB_VIEW, env={"MY_KEY": secret})["stdout"]
    )
    assert seen["env"] == {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/mnt/data",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": "/mnt/data",
        "MY_KEY": secret,
    }
    fds = seen["fds"]
    assert set(fds) == {"0", "1", "2"}, fds
    assert all(target.startswith(("pipe:", "/dev/null")) for target in fds.values()), fds
    mounts = seen["mountinfo"]
    assert runner.token not in mounts
    for state in ("input-cache", "workspace-images", "runner.log", "uid-leases"):
        assert state not in mounts, state
    assert not seen["sys"]
    assert all(line.endswith(":/") for line in seen["cgroup"].splitlines()), seen["cgroup"]
    assert runner.token not in json.dumps(seen["procs"])

    after = json.loads(execute(runner, language="python", code=_JOB_VIEW)["stdout"])
    assert "MY_KEY" not in after["env"]
    assert secret not in json.dumps(after)


def test_job_cannot_write_system_dirs(runner: RunnerProcess) -> None:
    code = (
        "import os\n"
        "for path in ('/usr/evil', '/etc/evil', '/bin/evil', '/evil', '/mnt/evil'):\n"
        "    try:\n"
        "        open(path, 'w').write('x'); print('WROTE', path)\n"
        "    except OSError as exc:\n"
        "        print('denied', path, exc.errno)\n"
    )
    result = execute(runner, language="python", code=code)
    assert "WROTE" not in result["stdout"], result
    assert result["stdout"].count("denied") == 5
    assert not Path("/usr/evil").exists()


def test_namespace_and_privileged_syscalls_fail(runner: RunnerProcess) -> None:
    code = r"""
import ctypes, ctypes.util, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER = 0x10000000
def check(name, rc):
    print(name, 'FAILED' if rc == -1 else 'SUCCEEDED', ctypes.get_errno())
check('unshare', libc.unshare(CLONE_NEWUSER))
libc.syscall.restype = ctypes.c_long
check('clone', libc.syscall(56, CLONE_NEWUSER | 17, 0, 0, 0, 0))
check('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))
check('ptrace', libc.ptrace(16, 1, 0, 0))
r = subprocess.run(['unshare', '-U', 'true'], capture_output=True)
print('unshare-cmd', 'FAILED' if r.returncode else 'SUCCEEDED')
"""
    result = execute(runner, language="python", code=code)
    out = result["stdout"]
    assert "SUCCEEDED" not in out, result
    for name in ("unshare", "clone", "mount", "ptrace", "unshare-cmd"):
        assert f"{name} FAILED" in out


def test_threads_still_work(runner: RunnerProcess) -> None:
    """clone3 answers ENOSYS and libc falls back: threads and subprocesses work."""
    code = (
        "import threading, subprocess\n"
        "out = []\n"
        "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "sub = subprocess.run(['echo', 'sub'], capture_output=True, text=True).stdout\n"
        "print(sorted(out), sub)\n"
    )
    result = execute(runner, language="python", code=code)
    assert result["stdout"] == "[0, 1, 2, 3, 4, 5, 6, 7] sub\n\n"


def test_planted_symlink_is_never_read_through(runner: RunnerProcess) -> None:
    code = "import os\nos.symlink('/etc/shadow', 'x')\nos.symlink('/etc', 'etcdir')\n"
    result = execute(runner, language="python", code=code)
    files = {f["name"]: f for f in result["files"]}
    assert files["x"]["symlink_target"] == "/etc/shadow"
    assert files["x"]["content_b64"] is None
    assert files["etcdir"]["symlink_target"] == "/etc"
    # Nothing under /etc was walked into through the link.
    assert not any(name.startswith("etcdir/") for name in files)
    shadow = Path("/etc/shadow").read_bytes()
    for f in result["files"]:
        if f["content_b64"]:
            assert unb64(f["content_b64"]) != shadow


def test_sixteen_concurrent_jobs_see_only_their_own_workspace(runner: RunnerProcess) -> None:
    """Each of 16 concurrent jobs sees only its own workspace, and no two jobs that ran at
    the same time shared a UID (a UID returns to the pool after its job: jobs that did not
    overlap, as on a loaded machine, may reuse one)."""
    code = (
        "import os, sys, time\n"
        "start = time.time()\n"
        "open(f'job-{sys.argv[1]}.txt', 'w').write(sys.argv[1])\n"
        "time.sleep(0.5)\n"
        "print(sorted(os.listdir('.')), os.getuid(), start, time.time())\n"
    )
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(
                lambda i: execute(runner, language="python", code=code, args=[str(i)]),
                range(16),
            )
        )
    spans = []
    for i, result in enumerate(results):
        listing, uid, start, end = result["stdout"].rsplit(" ", 3)
        assert listing == str([f"job-{i}.txt"]), result
        spans.append((int(uid), float(start), float(end)))
    overlapping = [
        (a, b) for a, b in itertools.combinations(spans, 2) if a[1] < b[2] and b[1] < a[2]
    ]
    assert overlapping, spans
    assert all(a[0] != b[0] for a, b in overlapping), overlapping


def test_disk_quota_stops_many_medium_files(runner_factory: StartRunner) -> None:
    runner = runner_factory(SANDCELL_RUNNER_WORKSPACE_QUOTA_MIB="64")
    code = (
        "for i in range(5):\n"
        "    with open(f'f{i}.bin', 'wb') as f: f.write(b'x' * 20 * 1024 * 1024)\n"
        "    print('wrote', i, flush=True)\n"
    )
    result = execute(runner, language="python", code=code, limits={"memory_mib": 512})
    assert result["status"] == "disk_limit", result
    assert "wrote 4" not in result["stdout"]


def test_busy_past_max_jobs(runner_factory: StartRunner) -> None:
    runner = runner_factory(SANDCELL_RUNNER_MAX_JOBS="1")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(execute, runner, language="bash", code="sleep 2; echo slow")
        time.sleep(0.7)
        response = httpx.post(
            runner.url + "/v1/execute",
            json={"language": "bash", "code": "echo fast"},
            headers=runner.headers(),
        )
        assert slow.result()["stdout"] == "slow\n"
    assert response.status_code == 503
    body = response.json()["error"]
    assert body["code"] == "busy"
    assert body["retryable"] is True
    assert int(response.headers["retry-after"]) >= 1


@pytest.mark.parametrize("method", SPAWN_METHODS)
def test_sigkill_of_runner_leaves_no_jail_behind(runner_factory: StartRunner, method: str) -> None:
    """The runner's death kills its helper, whose death kills every nsjail (death
    signals both), on both of the helper's paths."""
    runner = runner_factory(SANDCELL_RUNNER_SPAWN_VFORK="1" if method == "vfork" else "0")
    with httpx.stream(
        "POST",
        runner.url + "/v1/execute",
        json={"language": "bash", "code": "echo up; sleep 100"},
        headers=runner.headers(Accept="application/x-ndjson"),
        timeout=30,
    ) as response:
        # Keep the iterator: a discarded one closes the response, and the runner then
        # (rightly) cancels the job of a client that went away.
        lines = response.iter_lines()
        first = json.loads(next(lines))
        assert first == {"type": "stdout", "data": "up\n"}
        parent = psutil.Process(runner.process.pid)
        descendants = parent.children(recursive=True)
        assert any("nsjail" in " ".join(_cmdline(p)) for p in descendants)
        (helper,) = [p for p in parent.children() if "spawnd.py" in " ".join(_cmdline(p))]
        assert helper_method(helper.pid) == method
        os.kill(runner.process.pid, signal.SIGKILL)
        runner.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    alive = descendants
    while alive and time.monotonic() < deadline:
        alive = [p for p in descendants if _alive(p)]
        time.sleep(0.05)
    assert not alive, [_cmdline(p) for p in alive]

    # The dead runner's job cgroups outlive it; the next runner on its root reaps them
    # at start-up, and a clean stop removes its whole subtree.
    subtrees = [
        CGROUP_ROOT / controller / "sandcell" / instance_key(runner.workspace_root)
        for controller in ("memory", "pids")
    ]
    assert all(list(tree.glob("job-*")) for tree in subtrees)
    restarted = start_runner(runner.root)
    try:
        assert not [job for tree in subtrees for job in tree.glob("job-*")]
    finally:
        restarted.stop()
    assert not [tree for tree in subtrees if tree.exists()]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # exited, or a zombie not yet reaped
        return []


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
