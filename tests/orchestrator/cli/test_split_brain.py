"""Two orchestrators, one Redis, one S3: a holder paused past its lock TTL cannot win.

Orchestrator A is a ``sandcell exec`` process whose S3 traffic goes through a
proxy owned by this test. A runs a turn and starts committing its checkpoint;
the proxy holds that request and the test SIGSTOPs A until its lock has expired
in Redis. Orchestrator B (another ``sandcell exec``) then takes the session.
The record says A's turn is still open (A never committed it, and its job may
have written to the live sandbox), so B does not reuse A's live sandbox (the
local provider's runtime directory is shared): it replaces it from the last
committed checkpoint (none yet) and commits a turn of its own. A is SIGCONTed
and its held upload goes through, but A's turn is never acknowledged. The next
turn (C) restores from what the registry points at: it must see B's state and
nothing of A's unacknowledged turn, and the registry must never point at the
object A wrote.

Only the CLI, Redis and S3 are touched, so the same test runs against any
version of the orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import boto3
import psutil
import pytest
import redis.asyncio

from sandcell_orchestrator.registry import RedisRegistry
from sandcell_protocol import runtime_session_id
from tests.orchestrator.conftest import BUCKET, S3_ACCESS, S3_SECRET, S3Server

from .conftest import Cli

# A short lock TTL: (launch + health + execute + checkpoint) x 1.5 = 15 s.
_BUDGETS = {
    "SANDCELL_LAUNCH_TIMEOUT_S": "6",
    "SANDCELL_HEALTH_TIMEOUT_S": "2",
    "SANDCELL_EXECUTE_TIMEOUT_S": "1",
    "SANDCELL_CHECKPOINT_TIMEOUT_S": "1",
}
_WAIT_S = 120.0
"""A bound on each wait, so a broken run fails instead of hanging (not a timing check)."""


@dataclass
class HoldingProxy:
    """A TCP proxy to S3 that holds the first request committing a checkpoint object.

    ``held`` is set when that request arrives (A is then inside its upload); its
    bytes go on to S3 only once ``release`` is set. Every other request passes.
    """

    upstream_port: int
    marker: bytes
    held: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    held_request_line: str = ""
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _is_commit(self, chunk: bytes) -> bool:
        # A request on a kept-alive connection starts at a chunk boundary: the
        # client waits for each answer before it sends the next request.
        line = chunk.split(b"\r\n", 1)[0]
        return line.startswith(b"PUT ") and self.marker in line and b"/.staging/" not in line

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        back = asyncio.create_task(self._pipe(up_reader, writer))
        self._tasks.add(back)
        back.add_done_callback(self._tasks.discard)
        try:
            while chunk := await reader.read(65536):
                if not self.held.is_set() and self._is_commit(chunk):
                    self.held_request_line = chunk.split(b"\r\n", 1)[0].decode()
                    self.held.set()
                    await self.release.wait()
                up_writer.write(chunk)
                await up_writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            up_writer.close()
            with contextlib.suppress(Exception):
                await back

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def proxy(s3_server: S3Server) -> AsyncIterator[HoldingProxy]:
    held = HoldingProxy(upstream_port=s3_server.port, marker=b"/checkpoints/")
    await held.start()
    try:
        yield held
    finally:
        await held.close()


async def _exec(cli: Cli, env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *cli.command(),
        "exec",
        *args,
        env={**cli.env, **env},
        cwd=cli.home.parent,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _finish(process: asyncio.subprocess.Process) -> tuple[int, str, str]:
    async with asyncio.timeout(_WAIT_S):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def _exists(s3_server: S3Server, name: str) -> bool:
    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=S3_ACCESS,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
    )
    try:
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix=name)
        return any(item["Key"] == name for item in listed.get("Contents", []))
    finally:
        client.close()


async def _until(condition: Callable[[], Awaitable[bool]]) -> None:
    async with asyncio.timeout(_WAIT_S):
        while not await condition():
            await asyncio.sleep(0.1)


async def test_a_paused_holder_never_overwrites_a_newer_turn(
    cli: Cli, s3_server: S3Server, redis_url: str, proxy: HoldingProxy
) -> None:
    """A's upload lands after B's turn, yet the next turn sees B's state (without
    A's unacknowledged write), and the registry never points at A's object."""
    hint = f"split-{uuid.uuid4().hex[:12]}"
    session_id = runtime_session_id("cli", pwd.getpwuid(os.getuid()).pw_name, hint)
    prefix = f"split-{uuid.uuid4().hex}"
    shared = {
        **_BUDGETS,
        "SANDCELL_REGISTRY_URL": redis_url,
        "SANDCELL_SNAPSHOT_URL": f"s3://{BUCKET}/{prefix}",
        "SANDCELL_S3_ACCESS_KEY": S3_ACCESS,
        "SANDCELL_S3_SECRET_KEY": S3_SECRET,
        "SANDCELL_S3_REGION": "us-east-1",
    }
    via_proxy = {**shared, "SANDCELL_S3_ENDPOINT": f"http://127.0.0.1:{proxy.port}"}
    direct = {**shared, "SANDCELL_S3_ENDPOINT": s3_server.endpoint}
    registry = RedisRegistry.from_url(redis_url)
    client = redis.asyncio.Redis.from_url(redis_url)
    first = await _exec(cli, via_proxy, "--session", hint, "open('f', 'w').write('A')")
    stopped = False
    try:
        async with asyncio.timeout(_WAIT_S):
            await proxy.held.wait()  # A is committing its checkpoint
        os.kill(first.pid, signal.SIGSTOP)
        stopped = True
        record = await registry.get(session_id)
        assert record is not None
        assert record.turn_open  # A's job ran, its commit is held
        runner = json.loads((cli.runtime_dir / record.sandbox_id / "sandbox.json").read_text())

        async def lock_expired() -> bool:
            return not await client.exists(f"{registry.prefix}lock:{session_id}")

        await _until(lock_expired)
        second = await _exec(cli, direct, "--session", hint, "open('f', 'a').write('B')")
        code, _, err = await _finish(second)
        assert code == 0, err
        after_b = await registry.get(session_id)
        assert after_b is not None
        # B replaced A's live sandbox: A's uncommitted write must not become B's state.
        assert after_b.sandbox_id != record.sandbox_id
        assert not after_b.turn_open

        os.kill(first.pid, signal.SIGCONT)
        stopped = False
        proxy.release.set()
        code, _, err = await _finish(first)
        assert code != 0, "A's turn lost its lock: it must not be acknowledged"

        async def runner_gone() -> bool:
            try:
                return psutil.Process(runner["pid"]).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        await _until(runner_gone)
        stale_key = proxy.held_request_line.split(" ")[1].split(f"/{prefix}/", 1)[1]
        # A's upload did land (under its own key), after B's commit.
        assert await asyncio.to_thread(_exists, s3_server, f"{prefix}/{stale_key}")
        pointed = await registry.get(session_id)
        assert pointed is not None
        assert pointed.checkpoint_key is not None
        assert pointed.checkpoint_key != stale_key

        third = await _exec(cli, direct, "--session", hint, "print(open('f').read())")
        code, out, err = await _finish(third)
        assert (code, out) == (0, "B\n"), err
        final = await registry.get(session_id)
        assert final is not None
        assert final.checkpoint_key != stale_key
    finally:
        if stopped:
            os.kill(first.pid, signal.SIGCONT)
        proxy.release.set()
        if first.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                first.kill()
            await first.wait()
        done = await asyncio.create_subprocess_exec(
            *cli.command(),
            "sessions",
            "destroy",
            hint,
            env={**cli.env, **direct},
            cwd=cli.home.parent,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await done.wait()
        await registry.close()
        await client.aclose()
