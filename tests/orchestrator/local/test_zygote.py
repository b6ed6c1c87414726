"""Runners forked from the local provider's zygote: apart from each other, and from it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psutil

from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.testing import sandbox_processes
from sandcell_protocol import ExecuteRequest
from tests.fixtures.paths import traversable_dir

from .test_pid_reuse import _state

_WAIT_S = 120.0


def _pid(runtime: Path, handle: SandboxHandle) -> int:
    return int(str(_state(runtime, handle.sandbox_id)["pid"]))


async def _forked(provider: LocalProvider, runtime: Path, made: list[str]) -> SandboxHandle:
    """A sandbox whose runner the zygote forked: the first launches start the zygote and
    run plainly while it imports, so create until one comes from it."""
    deadline = time.monotonic() + _WAIT_S
    while True:
        handle = await provider.create(SandboxSpec())
        made.append(handle.sandbox_id)
        zygote = provider._zygote.pid if provider._zygote is not None else None
        if zygote is not None and psutil.Process(_pid(runtime, handle)).ppid() == zygote:
            return handle
        await handle.close()
        assert time.monotonic() < deadline, "no runner was forked from the zygote"
        await asyncio.sleep(0.2)


async def _serves(handle: SandboxHandle, code: str = "print(6 * 7)") -> str:
    result = await handle.runner.execute(ExecuteRequest(language="python", code=code))
    return result.stdout


def _environ(pid: int) -> dict[str, str]:
    environ: dict[str, str] = psutil.Process(pid).environ()
    return environ


def _listening_ports(pid: int) -> set[int]:
    return {
        c.laddr.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


async def test_forked_runners_serve_each_with_its_own_environment_token_and_socket() -> None:
    """Two runners from one zygote: each runs jobs; each shows its own environment (its
    own workspace root, no token) as a plain runner does; neither takes the
    other's token; each holds its own listener and no sibling's; and the provider's
    process listing finds them, not the zygote."""
    with traversable_dir("zygote-") as base:
        runtime = base / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        made: list[str] = []
        try:
            one = await _forked(provider, runtime, made)
            two = await _forked(provider, runtime, made)
            assert await _serves(one) == "42\n"
            assert await _serves(two) == "42\n"
            pids = {handle.sandbox_id: _pid(runtime, handle) for handle in (one, two)}
            for handle in (one, two):
                pid = pids[handle.sandbox_id]
                environ = _environ(pid)
                assert environ["SANDCELL_WORKSPACE_ROOT"] == str(
                    runtime / handle.sandbox_id / "workspaces"
                )
                # As a plain runner's: the token's pipe is named, the token is not there.
                token = str(_state(runtime, handle.sandbox_id)["token"])
                assert "SANDCELL_RUNNER_TOKEN" not in environ
                assert not any(token in value for value in environ.values())
                assert "SANDCELL_ZYGOTE_ENV_SPACE" not in environ
                assert "sandcell_runner" in " ".join(psutil.Process(pid).cmdline())
                assert psutil.Process(pid).pid == os.getpgid(pid) == os.getsid(pid)
            assert _listening_ports(pids[one.sandbox_id]) == {int(one.endpoint.rsplit(":", 1)[1])}
            assert _listening_ports(pids[two.sandbox_id]) == {int(two.endpoint.rsplit(":", 1)[1])}
            token_one = str(_state(runtime, one.sandbox_id)["token"])
            async with httpx.AsyncClient(base_url=two.endpoint) as client:
                refused = await client.post(
                    "/v1/execute",
                    json={"language": "python", "code": "print(1)"},
                    headers={"Authorization": f"Bearer {token_one}"},
                )
            assert refused.status_code == 401
            listed = {p.pid for p in sandbox_processes(runtime)}
            assert set(pids.values()) <= listed
            assert provider._zygote is not None
            assert provider._zygote.pid not in listed
            await one.close()
            await two.close()
        finally:
            await provider.close()
            for sandbox_id in made:
                await provider.destroy(sandbox_id)


async def test_a_killed_zygote_leaves_its_runners_and_the_next_launches_work() -> None:
    """SIGKILL the zygote: the runner it forked goes on serving (it does not die with
    the zygote), the next create still answers (plainly), and a later one comes from a
    new zygote."""
    with traversable_dir("zygote-") as base:
        runtime = base / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        made: list[str] = []
        try:
            first = await _forked(provider, runtime, made)
            assert provider._zygote is not None
            old = provider._zygote.pid
            assert old is not None
            zygote = psutil.Process(old)
            zygote.kill()
            zygote.wait(timeout=30)
            assert await _serves(first) == "42\n"
            after = await provider.create(SandboxSpec())
            made.append(after.sandbox_id)
            assert await _serves(after) == "42\n"
            again = await _forked(provider, runtime, made)
            assert provider._zygote.pid not in (None, old)
            assert await _serves(again) == "42\n"
            for handle in (first, after, again):
                await handle.close()
        finally:
            await provider.close()
            for sandbox_id in made:
                await provider.destroy(sandbox_id)


async def test_close_stops_the_zygote_and_destroy_still_ends_forked_runners() -> None:
    """``close`` leaves no zygote process; a forked runner handed out before is still
    destroyed by ``destroy`` (its process group killed, its root removed)."""
    with traversable_dir("zygote-") as base:
        runtime = base / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        made: list[str] = []
        try:
            handle = await _forked(provider, runtime, made)
            runner = psutil.Process(_pid(runtime, handle))
            assert provider._zygote is not None
            assert provider._zygote.pid is not None
            zygote = psutil.Process(provider._zygote.pid)
            await handle.close()
        finally:
            await provider.close()
        assert not zygote.is_running()
        assert runner.is_running()
        for sandbox_id in made:
            await provider.destroy(sandbox_id)
        runner.wait(timeout=30)
        assert sorted(runtime.iterdir()) == []


_ORPHANED = textwrap.dedent(
    """
    import asyncio, sys, time
    sys.path.insert(0, sys.argv[2])
    from tests.orchestrator.local.test_zygote import _forked
    from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
    from pathlib import Path

    async def main():
        runtime = Path(sys.argv[1])
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        handle = await _forked(provider, runtime, [])
        print(provider._zygote.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_forked_runners_and_the_zygote_die_with_the_provider_process() -> None:
    """The process that started them is SIGKILLed: the zygote (its death signal) and the
    forked runner (it watches that process) both go, as a plain runner does."""
    with traversable_dir("zygote-") as base:
        runtime = base / "rt"
        root = Path(__file__).resolve().parents[3]
        launcher = subprocess.Popen(
            [sys.executable, "-c", _ORPHANED, str(runtime), str(root)],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            assert launcher.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(launcher.stdout.readline), _WAIT_S)
            zygote = psutil.Process(int(line))
            runners = [
                p
                for p in sandbox_processes(runtime)
                if p.pid != launcher.pid and "sandcell_runner" in " ".join(p.cmdline())
            ]
            assert any(p.ppid() == zygote.pid for p in runners)
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
            _, alive = psutil.wait_procs([zygote, *runners], timeout=60)
            assert alive == []
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
            if launcher.stdout is not None:
                launcher.stdout.close()
            for process in sandbox_processes(runtime):
                process.kill()


def _extractor_servers(runner: int) -> list[psutil.Process]:
    """The runner's restore fork servers: children that are neither its spawn helper nor
    a passing mkfs (a forked one shows the runner's own command line)."""
    own = psutil.Process(runner).cmdline()
    return [
        child
        for child in psutil.Process(runner).children()
        if child.cmdline() == own
        or "sandcell_runner.checkpoint.extractor_server" in child.cmdline()
    ]


async def test_a_forked_runner_forks_its_restore_server_holding_nothing_of_the_runner() -> None:
    """A forked runner's extractor fork server is forked too (no interpreter start and
    imports: ~80 CPU-ms of every cold start) and holds what a fresh one did: no
    descriptor of the runner's but its log (the token's pipe, the listener and the
    launcher's pidfd are closed), no environment; and it serves a restore."""
    with traversable_dir("zygote-") as base:
        runtime = base / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        made: list[str] = []
        try:
            one = await _forked(provider, runtime, made)
            two = await _forked(provider, runtime, made)
            for handle in (one, two):
                runner = _pid(runtime, handle)
                servers = _extractor_servers(runner)
                assert len(servers) == 1, servers
                server = servers[0]
                # Forked, not exec'd: the runner's own command line.
                assert server.cmdline() == psutil.Process(runner).cmdline()
                assert server.ppid() == runner
                assert os.getsid(server.pid) == server.pid
                assert server.environ() == {}
                fds = {
                    int(fd): os.readlink(f"/proc/{server.pid}/fd/{fd}")
                    for fd in os.listdir(f"/proc/{server.pid}/fd")
                }
                assert set(fds) == {0, 1, 2}, fds
                assert fds[0].startswith("socket:")
                assert fds[1] == "/dev/null"
                assert fds[2] == str(runtime / handle.sandbox_id / "runner.log")
            await one.files.write("kept.txt", "restored")
            async with one.runner.checkpoint(session_id=one.session_id) as stream:
                chunks = [chunk async for chunk in stream]

            async def replay() -> AsyncIterator[bytes]:
                for chunk in chunks:
                    yield chunk

            # The session moves to the second runner, as a resumed one does.
            session = one.session_id
            await two.runner.restore(replay(), session_id=session, sha256=stream.sha256)
            assert await two.runner.read_file("kept.txt", session_id=session) == b"restored"
            await one.close()
            await two.close()
        finally:
            await provider.close()
            for sandbox_id in made:
                await provider.destroy(sandbox_id)
