"""E2B's SDK against ``sandcell serve``: filesystem RPCs and watch, PTY, reattach,
timeouts, pause and connect.

The real ``e2b`` package (sync and async) over real HTTP, real runners and nsjail
underneath (local provider). Deadlines are polled, never asserted as speeds.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    FileType,
    PtySize,
    Sandbox,
    SandboxState,
)
from e2b.exceptions import NotFoundException, SandboxException

from tests.e2b_api.conftest import E2bServe


@pytest.fixture(scope="module")
def sbx(e2b_serve: E2bServe) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(**e2b_serve.opts())
    try:
        yield sandbox
    finally:
        sandbox.kill()


def _until(check: Callable[[], bool], *, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.1)


def test_filesystem_calls(sbx: Sandbox) -> None:
    """list (with depth), exists, make_dir, rename, remove, get_info, over the RPCs."""
    sbx.files.write("/home/user/tree/a.txt", "A")
    sbx.files.write("tree/sub/b.txt", "BB")
    top = {e.name: e for e in sbx.files.list("/home/user/tree")}
    assert set(top) == {"a.txt", "sub"}
    assert top["a.txt"].type == FileType.FILE
    assert top["a.txt"].size == 1
    assert top["sub"].type == FileType.DIR
    assert top["a.txt"].path == "/home/user/tree/a.txt"
    deep = {e.path for e in sbx.files.list("tree", depth=2)}
    assert "/home/user/tree/sub/b.txt" in deep

    assert sbx.files.exists("tree/a.txt") is True
    assert sbx.files.exists("tree/nope.txt") is False
    assert sbx.files.make_dir("/home/user/made/deeper") is True
    assert sbx.files.make_dir("made/deeper") is False
    assert sbx.files.get_info("made/deeper").type == FileType.DIR

    moved = sbx.files.rename("tree/a.txt", "/home/user/moved/a2.txt")
    assert moved.path == "/home/user/moved/a2.txt"
    assert sbx.files.read("moved/a2.txt") == "A"
    assert sbx.files.exists("tree/a.txt") is False

    sbx.files.remove("tree")
    assert sbx.files.exists("tree") is False
    with pytest.raises(NotFoundException):
        sbx.files.get_info("tree/sub/b.txt")
    with pytest.raises(SandboxException):
        sbx.files.list("/etc")


def test_a_file_of_any_name_reads_back(sbx: Sandbox, e2b_serve: E2bServe) -> None:
    """``GET /files`` of a name a header cannot carry as it is (not Latin-1) answers its
    bytes, named by RFC 6266's ``filename*``; was a 500."""
    sbx.files.write("报告.txt", "report")
    assert sbx.files.read("/home/user/报告.txt") == "report"
    answer = httpx.get(
        f"{e2b_serve.url}/e2b/sandbox/files",
        params={"path": "报告.txt"},
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""},
    )
    assert answer.status_code == 200, answer.text
    disposition = answer.headers["content-disposition"]
    assert disposition.endswith("filename*=UTF-8''%E6%8A%A5%E5%91%8A.txt"), disposition


# A newline anywhere (at the end too), other control characters, DEL: names a job can
# make. The runner's file route matched none with a newline inside, and ``ends\n`` as
# ``ends``, another file.
_ODD_NAMES = ["a\nb", "ends\n", "ctl\t\r\x01\x1b\x7f\nx"]


@pytest.mark.parametrize("name", _ODD_NAMES)
def test_a_file_name_with_control_characters_moves_like_any(sbx: Sandbox, name: str) -> None:
    """write, read, list, exists, get_info, rename and remove of a name holding a newline
    and other control characters, and a read of one a command made; a missing one is the
    same ``NotFoundException`` as ever."""
    home = "/home/user/ctl"
    sbx.files.write(f"ctl/{name}", name)
    assert sbx.files.read(f"{home}/{name}") == name
    assert sbx.files.read(f"ctl/{name}", format="bytes") == name.encode()
    assert sbx.files.exists(f"ctl/{name}") is True
    assert sbx.files.exists("ctl/ends") is False
    info = sbx.files.get_info(f"ctl/{name}")
    assert (info.name, info.type, info.path) == (name, FileType.FILE, f"{home}/{name}")
    assert [(e.name, e.path) for e in sbx.files.list(home)] == [(name, f"{home}/{name}")]
    moved = sbx.files.rename(f"ctl/{name}", f"ctl/{name}\tmoved")
    assert moved.path == f"{home}/{name}\tmoved"
    assert sbx.files.read(f"ctl/{name}\tmoved") == name
    sbx.files.remove(f"ctl/{name}\tmoved")
    assert sbx.files.exists(f"ctl/{name}\tmoved") is False
    with pytest.raises(NotFoundException) as missing:
        sbx.files.read(f"ctl/{name}")
    assert str(missing.value) == f"path {'ctl/' + name!r} not found"

    sbx.commands.run(f"printf made > {shlex.quote(f'{home}/{name}')}")
    assert sbx.files.read(f"ctl/{name}") == "made"
    sbx.files.remove("ctl")


def test_several_files_of_control_character_names_upload_at_once(sbx: Sandbox) -> None:
    """``write_files`` of several, one request per file (octet-stream, the path a query
    parameter): each lands under its name. As multipart, a part's filename is its path as
    the client's HTML5 form encoder sent it (httpx: a newline as ``%0A``), taken as sent,
    as envd takes it (Go's ``mime.ParseMediaType``): decoding would misname a file whose
    name holds a literal ``%0A``."""
    paths = [f"/home/user/many/{name}" for name in _ODD_NAMES]
    written = sbx.files.write_files([{"path": p, "data": p} for p in paths], use_octet_stream=True)
    assert [w.path for w in written] == paths
    for path in paths:
        assert sbx.files.read(path) == path
    assert sorted(e.path for e in sbx.files.list("many")) == sorted(paths)
    sbx.files.remove("many")

    as_parts = sbx.files.write_files(
        [{"path": "many/a\nb", "data": "x"}, {"path": "c", "data": "y"}]
    )
    assert [w.path for w in as_parts] == ["/home/user/many/a%0Ab", "/home/user/c"]
    sbx.files.remove("many")
    sbx.files.remove("c")


def test_no_link_is_followed(sbx: Sandbox) -> None:
    """A link a command planted is reported as a link, never read through."""
    sbx.commands.run("ln -s /etc/passwd /home/user/pw")
    info = sbx.files.get_info("pw")
    assert info.type is None or info.type != FileType.FILE
    assert info.symlink_target == "/etc/passwd"
    with pytest.raises(SandboxException):
        sbx.files.read("pw")


def test_watch_dir_sees_a_write(sbx: Sandbox) -> None:
    """The sync SDK's polling watcher reports a file written after it started."""
    sbx.files.make_dir("watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("watched/new.txt", "content")
        seen: list[tuple[str, FilesystemEventType]] = []

        def written() -> bool:
            seen.extend((e.name, e.type) for e in handle.get_new_events())
            return ("new.txt", FilesystemEventType.WRITE) in seen

        _until(written)
        assert ("new.txt", FilesystemEventType.CREATE) in seen
    finally:
        handle.stop()


def test_pty_echoes_typed_input_and_resizes(sbx: Sandbox) -> None:
    """A PTY is a real terminal in the jail: typed input comes back, resize reaches stty."""
    output = bytearray()
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    try:
        sbx.pty.send_stdin(handle.pid, b"stty size; echo typed-$((6*7))\n")

        def read_until(marker: bytes) -> None:
            for _, _, pty in handle:
                if pty:
                    output.extend(pty)
                if marker in output:
                    return
            raise AssertionError(f"PTY ended before {marker!r}: {bytes(output)!r}")

        read_until(b"typed-42")
        assert b"24 80" in output
        sbx.pty.resize(handle.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(handle.pid, b"stty size\n")
        read_until(b"30 100")
    finally:
        assert sbx.pty.kill(handle.pid) is True


def test_connect_reattaches_to_a_running_command(sbx: Sandbox) -> None:
    """``commands.connect(pid)`` follows a background command started by another call."""
    started = sbx.commands.run(
        "sleep 1; for i in 1 2 3; do echo line-$i; done; exit 4", background=True
    )
    started.disconnect()
    attached = sbx.commands.connect(started.pid)
    with pytest.raises(CommandExitException) as raised:
        attached.wait()
    assert raised.value.exit_code == 4
    assert "line-3" in raised.value.stdout


def test_pause_then_connect_keeps_the_files(e2b_serve: E2bServe) -> None:
    """Pause checkpoints and stops the sandbox; connect resumes it with its files."""
    sandbox = Sandbox.create(**e2b_serve.opts())
    try:
        sandbox.files.write("keep/me.txt", "still here")
        sandbox.commands.run("echo from-a-command > keep/cmd.txt")
        assert sandbox.pause() is True
        info = Sandbox.get_info(sandbox.sandbox_id, **e2b_serve.opts())
        assert info.state == SandboxState.PAUSED
        assert sandbox.is_running() is False

        resumed = Sandbox.connect(sandbox.sandbox_id, **e2b_serve.opts())
        assert resumed.files.read("keep/me.txt") == "still here"
        assert resumed.commands.run("cat keep/cmd.txt").stdout == "from-a-command\n"
        info = Sandbox.get_info(sandbox.sandbox_id, **e2b_serve.opts())
        assert info.state == SandboxState.RUNNING
    finally:
        Sandbox.kill(sandbox.sandbox_id, **e2b_serve.opts())


def test_set_timeout_then_expiry_kills(e2b_serve: E2bServe) -> None:
    """A sandbox past its timeout is killed (set_timeout shortens it)."""
    sandbox = Sandbox.create(timeout=300, **e2b_serve.opts())
    sandbox.set_timeout(1)

    def gone() -> bool:
        try:
            Sandbox.get_info(sandbox.sandbox_id, **e2b_serve.opts())
        except NotFoundException:
            return True
        return False

    _until(gone)
    assert sandbox.is_running() is False


def test_timeout_with_auto_pause_pauses(e2b_serve: E2bServe) -> None:
    """``on_timeout: pause`` pauses instead of killing; connect brings the files back."""
    sandbox = Sandbox.create(timeout=1, lifecycle={"on_timeout": "pause"}, **e2b_serve.opts())
    try:
        sandbox.files.write("p.txt", "paused by timeout")

        def paused() -> bool:
            info = Sandbox.get_info(sandbox.sandbox_id, **e2b_serve.opts())
            return bool(info.state == SandboxState.PAUSED)

        _until(paused)
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=300, **e2b_serve.opts())
        assert resumed.files.read("p.txt") == "paused by timeout"
    finally:
        Sandbox.kill(sandbox.sandbox_id, **e2b_serve.opts())


async def test_async_filesystem_and_watch(e2b_serve: E2bServe) -> None:
    """``AsyncSandbox``: the WatchDir stream sees a write; list, make_dir, remove."""
    sandbox = await AsyncSandbox.create(**e2b_serve.opts())
    try:
        await sandbox.files.make_dir("w")
        seen: list[tuple[str, FilesystemEventType]] = []
        wrote = asyncio.Event()

        def on_event(event: object) -> None:
            seen.append((event.name, event.type))  # type: ignore[attr-defined]
            if (event.name, event.type) == ("f.txt", FilesystemEventType.WRITE):  # type: ignore[attr-defined]
                wrote.set()

        handle = await sandbox.files.watch_dir("w", on_event=on_event)
        try:
            await sandbox.files.write("w/f.txt", "x")
            await asyncio.wait_for(wrote.wait(), 30)
        finally:
            await handle.stop()
        names = [e.name for e in await sandbox.files.list("/home/user/w")]
        assert names == ["f.txt"]
        await sandbox.files.remove("w/f.txt")
        assert await sandbox.files.exists("w/f.txt") is False
    finally:
        await sandbox.kill()
