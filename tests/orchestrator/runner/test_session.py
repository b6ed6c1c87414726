"""Session routes through RunnerClient and SandboxHandle, against real session runners."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from sandcell_orchestrator.errors import (
    ArchiveRejectedError,
    CheckpointError,
    RunnerRequestError,
    SessionBusyError,
    SessionConflictError,
)
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.runner.client import InputPayload, RunnerClient
from sandcell_protocol import ExecuteRequest, FileRef, input_cache_key, runtime_session_id

from .conftest import StartRunner

SESSION = runtime_session_id("ns", "user", "session-tests")
OTHER = runtime_session_id("ns", "user", "another")
AUTH = "Bearer ghp_sessionSecret0123456789"


@pytest.fixture
async def session_client(runner_factory: StartRunner) -> AsyncIterator[RunnerClient]:
    process = runner_factory()
    async with RunnerClient(process.url, token=process.token) as client:
        yield client


@pytest.fixture
def handle(session_client: RunnerClient) -> SandboxHandle:
    return SandboxHandle(
        sandbox_id="sb", provider="local", runner=session_client, session_id=SESSION
    )


async def _replay(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def test_files_round_trip(handle: SandboxHandle) -> None:
    """write → read/read_bytes → list → remove, with names that need quoting."""
    names = ["plain.txt", "dir with space/a#b?c.txt", "ünï/ß.txt"]
    for name in names:
        entry = await handle.files.write(name, f"content of {name}")
        assert entry.kind == "file"
        assert entry.name == name.rsplit("/", 1)[-1]
    for name in names:
        assert await handle.files.read(name) == f"content of {name}"
    binary = bytes(range(256))
    await handle.files.write("blob.bin", binary)
    assert await handle.files.read_bytes("blob.bin") == binary
    root = {entry.name: entry.kind for entry in await handle.files.list()}
    assert root == {
        "plain.txt": "file",
        "dir with space": "dir",
        "ünï": "dir",
        "blob.bin": "file",
    }
    assert [e.name for e in await handle.files.list("dir with space")] == ["a#b?c.txt"]
    await handle.files.remove("dir with space/a#b?c.txt")
    assert await handle.files.list("dir with space") == []
    with pytest.raises(RunnerRequestError) as caught:
        await handle.files.read("dir with space/a#b?c.txt")
    assert caught.value.code == "not_found"


async def test_reading_a_directory_or_listing_a_file_is_refused(handle: SandboxHandle) -> None:
    """The runner answers both with 200; the client tells them apart by content type."""
    await handle.files.write("d/f.json", '{"looks": "like a listing"}')
    with pytest.raises(RunnerRequestError, match="is a directory"):
        await handle.files.read("d")
    with pytest.raises(RunnerRequestError, match="not a directory"):
        await handle.files.list("d/f.json")
    assert await handle.files.read("d/f.json") == '{"looks": "like a listing"}'


async def test_write_with_mode(session_client: RunnerClient) -> None:
    """mode travels as an octal query value and lands on the file."""
    entry = await session_client.write_file(
        "run.sh", b"#!/bin/sh\necho ran\n", session_id=SESSION, mode=0o755
    )
    assert entry.mode == 0o755
    result = await session_client.execute(
        ExecuteRequest(language="bash", code="./run.sh"), session_id=SESSION
    )
    assert result.stdout == "ran\n"


async def test_commands_and_files_share_the_session_workspace(handle: SandboxHandle) -> None:
    """A file written through files is seen by a command in cwd, and vice versa."""
    await handle.files.write("work/in.txt", "from files")
    outcome = await handle.commands.run("cat in.txt; echo from-command > out.txt", cwd="work")
    assert outcome.stdout == "from files"
    assert await handle.files.read("work/out.txt") == "from-command\n"


async def test_git_workflow_with_a_local_remote(handle: SandboxHandle) -> None:
    """init, add, commit, branch, push to a bare repo in the workspace, clone it back; the
    credential passed to push and clone is nowhere in the workspace afterwards."""
    await handle.commands.run("git init -q --bare remote.git")
    await handle.git.init(branch="main", path="repo")
    await handle.files.write("repo/README.md", "hello\n")
    status = await handle.git.status(path="repo")
    assert "?? README.md" in status
    assert status.startswith("## No commits yet on main")
    await handle.git.add(["README.md"], path="repo")
    sha = await handle.git.commit(
        "first commit", author_name="Ada", author_email="ada@example.com", path="repo"
    )
    assert len(sha) == 40
    await handle.commands.run("git remote add origin ../remote.git", cwd="repo")
    await handle.git.push(path="repo", auth_header=AUTH)
    await handle.git.create_branch("feature/x", path="repo")
    await handle.files.write("repo/feature.txt", "f\n")
    await handle.git.add(path="repo")
    second = await handle.git.commit(
        "feature", author_name="Ada", author_email="ada@example.com", path="repo"
    )
    await handle.git.push("origin", "feature/x", path="repo", auth_header=AUTH)
    await handle.git.clone("remote.git", path="copy", branch="feature/x", auth_header=AUTH)
    assert await handle.files.read("copy/feature.txt") == "f\n"
    log = await handle.commands.run("git log --format='%H %an %s'", cwd="copy")
    assert log.stdout.splitlines()[0] == f"{second} Ada feature"
    assert log.stdout.splitlines()[1] == f"{sha} Ada first commit"
    leaks = await handle.commands.run("grep -rl ghp_ . || true; git -C copy remote -v")
    assert "ghp_" not in leaks.stdout
    assert "extraheader" not in (await handle.files.read("copy/.git/config")).lower()


async def test_checkpoint_restores_into_a_second_runner(
    handle: SandboxHandle, runner_factory: StartRunner
) -> None:
    """Checkpoint from A (hashed on the way through) → restore into B → same files."""
    await handle.files.write("state/data.txt", "survives")
    await handle.commands.run("ln -s data.txt state/link && mkdir -p empty")
    async with handle.runner.checkpoint(session_id=SESSION) as stream:
        chunks = [chunk async for chunk in stream]
    assert stream.complete
    assert stream.encoding == "zstd"
    assert stream.size_bytes == sum(len(c) for c in chunks)
    second = runner_factory()
    async with RunnerClient(second.url, token=second.token) as client_b:
        restored = await client_b.restore(_replay(chunks), session_id=SESSION, sha256=stream.sha256)
        assert restored.session_id == SESSION
        handle_b = SandboxHandle(
            sandbox_id="b", provider="local", runner=client_b, session_id=SESSION
        )
        assert await handle_b.files.read("state/data.txt") == "survives"
        names = {e.name: e for e in await handle_b.files.list("state")}
        assert names["link"].kind == "symlink"
        assert names["link"].symlink_target == "data.txt"
        assert {e.name for e in await handle_b.files.list()} >= {"state", "empty"}


async def test_gzip_checkpoint_and_a_wrong_digest(
    handle: SandboxHandle, runner_factory: StartRunner
) -> None:
    """gzip is negotiated on request; a body whose sha256 differs is ArchiveRejectedError."""
    await handle.files.write("f.txt", "x")
    async with handle.runner.checkpoint(session_id=SESSION, encoding="gzip") as stream:
        chunks = [chunk async for chunk in stream]
    assert stream.encoding == "gzip"
    assert chunks[0][:2] == b"\x1f\x8b"
    second = runner_factory()
    async with RunnerClient(second.url, token=second.token) as client_b:
        with pytest.raises(ArchiveRejectedError):
            await client_b.restore(_replay(chunks), session_id=SESSION, sha256="0" * 64)
        with pytest.raises(ArchiveRejectedError):
            await client_b.restore(_replay([b"not an archive"]), session_id=SESSION)
        await client_b.restore(_replay(chunks), session_id=SESSION, sha256=stream.sha256)
        assert await client_b.read_file("f.txt", session_id=SESSION) == b"x"


async def test_inputs_probe_push_and_prime(session_client: RunnerClient) -> None:
    """probe → missing; push → stored under input_cache_key; probe → nothing; execute primes."""
    ref = FileRef(storage_session="store-1", object_id="obj-1", name="inputs/data.csv")
    assert await session_client.probe_inputs([ref], session_id=SESSION) == [ref]
    payload = InputPayload(storage_session="store-1", object_id="obj-1", data=b"a,b\n1,2\n")
    stored = await session_client.push_inputs([payload, payload], session_id=SESSION)
    assert stored == [input_cache_key("store-1", "obj-1")]
    assert "a,b" not in repr(payload)
    assert await session_client.probe_inputs([ref], session_id=SESSION) == []
    result = await session_client.execute(
        ExecuteRequest(language="bash", code="cat inputs/data.csv", files=[ref]),
        session_id=SESSION,
    )
    assert result.stdout == "a,b\n1,2\n"


async def test_inputs_without_a_session(session_client: RunnerClient) -> None:
    """Stateless one-shots receive by-reference inputs too."""
    payload = InputPayload(storage_session="s", object_id="o", data=b"x" * (2 << 20))
    assert await session_client.push_inputs([payload]) == [input_cache_key("s", "o")]
    assert await session_client.push_inputs([]) == []


async def test_another_session_conflicts_until_release(session_client: RunnerClient) -> None:
    """A bound runner refuses another session (409 → SessionConflictError) until released."""
    noop = ExecuteRequest(language="bash", code="true")
    await session_client.execute(noop, session_id=SESSION)
    with pytest.raises(SessionConflictError):
        await session_client.execute(noop, session_id=OTHER)
    await session_client.release_session(session_id=SESSION)
    await session_client.execute(noop, session_id=OTHER)


async def test_concurrent_executes_in_one_session_get_busy(runner_factory: StartRunner) -> None:
    """The runner serializes a session; the one that waits too long gets SessionBusyError."""
    process = runner_factory(SANDCELL_RUNNER_SESSION_WAIT_MS="100")
    async with RunnerClient(process.url, token=process.token) as client:
        slow = asyncio.ensure_future(
            client.execute(ExecuteRequest(language="bash", code="sleep 2"), session_id=SESSION)
        )
        await asyncio.sleep(0.5)
        with pytest.raises(SessionBusyError) as caught:
            await client.execute(ExecuteRequest(language="bash", code="true"), session_id=SESSION)
        assert caught.value.retryable
        assert (await slow).exit_code == 0


async def test_a_failing_restore_source_surfaces_its_own_error(
    handle: SandboxHandle, runner_factory: StartRunner
) -> None:
    """A snapshot download that breaks mid-restore raises its own error (not masked as a
    transport failure), and the target keeps its workspace."""
    await handle.files.write("f.txt", "from A")
    async with handle.runner.checkpoint(session_id=SESSION) as stream:
        chunks = [chunk async for chunk in stream]

    async def broken() -> AsyncIterator[bytes]:
        yield chunks[0][: len(chunks[0]) // 2]
        raise CheckpointError("snapshot store went away")

    second = runner_factory()
    async with RunnerClient(second.url, token=second.token) as client_b:
        await client_b.write_file("kept.txt", b"B's own", session_id=SESSION)
        with pytest.raises(CheckpointError, match="went away"):
            await client_b.restore(broken(), session_id=SESSION)
        assert await client_b.read_file("kept.txt", session_id=SESSION) == b"B's own"
