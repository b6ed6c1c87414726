"""envd's ``filesystem.Filesystem``, served from the generated code the ``e2b`` package ships.

Each call is one ``FsRequest`` to the runner's sandbox filesystem route (the
runner's path checks: links never followed, nothing outside ``/home/user``).
Watching is by polling, here: a watcher keeps the last snapshot of the watched
tree (a bounded listing the runner makes) and reports the differences as envd's
events (``CREATE``, ``WRITE``, ``REMOVE``) — the polling calls
(``CreateWatcher``/``GetWatcherEvents``/``RemoveWatcher``, the sync SDK's) on
each poll, the ``WatchDir`` stream (the async SDK's) every ``WATCH_POLL_S``.
A sandbox holds at most ``MAX_WATCHERS`` polling watchers, and a tenant at most
``MAX_WATCH_STREAMS`` ``WatchDir`` streams on a worker: each stream polls on its own
every ``WATCH_POLL_S`` for as long as it is open, so streams cheap to open were
background work without bound (40 streams on an empty directory cost 0.6 CPU-s a
second; 200 made the host crawl). A stream's poll that finds the session busy (another
call held it past the runner's ``SANDCELL_RUNNER_SESSION_WAIT_MS``) is skipped: the
stream stays open and the next poll reports what changed meanwhile.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from sandcell_protocol import sandbox_messages as sm

from ..errors import SandcellError, SessionBusyError
from ..runner.sandbox import SandboxRunnerClient
from .codecs import strict_codecs
from .errors import connect_error
from .sandboxes import E2bSandbox

if TYPE_CHECKING:
    from connectrpc.request import RequestContext

__all__ = ["FilesystemService", "filesystem_app"]

log = logging.getLogger(__name__)

WATCH_POLL_S = 0.25
WATCH_KEEPALIVE_S = 15.0
MAX_WATCHERS = 32
MAX_WATCH_STREAMS = 32

SandboxOf = Callable[["RequestContext[object, object]"], E2bSandbox]
_TYPES = {
    "file": pb.FileType.FILE,
    "dir": pb.FileType.DIRECTORY,
    "symlink": pb.FileType.SYMLINK,
    "other": pb.FileType.UNSPECIFIED,
}
Snapshot = dict[str, tuple[str, int, int]]


def _one(name: str, value: object) -> Any:
    """A protobuf oneof value (the generated types spell each case as a literal)."""
    return Oneof(name, value)


def _entry(info: sm.EntryInfo) -> pb.EntryInfo:
    seconds, nanos = divmod(info.modified_time_ns, 1_000_000_000)
    return pb.EntryInfo(
        name=info.name,
        type=_TYPES[info.type],
        path=info.path,
        size=info.size,
        mode=info.mode,
        permissions=info.permissions,
        owner=info.owner,
        group=info.group,
        modified_time=Timestamp(seconds=seconds, nanos=nanos),
        symlink_target=info.symlink_target,
        is_symlink=info.type == "symlink",
    )


def _snapshot(root: str, entries: list[sm.EntryInfo]) -> Snapshot:
    prefix = root.rstrip("/") + "/"
    return {e.path.removeprefix(prefix): (e.type, e.size, e.modified_time_ns) for e in entries}


def _diff(before: Snapshot, after: Snapshot) -> list[pb.FilesystemEvent]:
    """envd-style events that turn ``before`` into ``after`` (a new file's content is a
    write, as inotify reports it)."""
    events: list[pb.FilesystemEvent] = []
    for name in sorted(after):
        kind, size, mtime = after[name]
        old = before.get(name)
        if old is None or old[0] != kind:
            if old is not None:
                events.append(pb.FilesystemEvent(name=name, type=pb.EventType.REMOVE))
            events.append(pb.FilesystemEvent(name=name, type=pb.EventType.CREATE))
            if kind == "file" and size > 0:
                events.append(pb.FilesystemEvent(name=name, type=pb.EventType.WRITE))
        elif kind == "file" and (old[1], old[2]) != (size, mtime):
            events.append(pb.FilesystemEvent(name=name, type=pb.EventType.WRITE))
    for name in sorted(set(before) - set(after)):
        events.append(pb.FilesystemEvent(name=name, type=pb.EventType.REMOVE))
    return events


@dataclass(eq=False)
class _Watcher:
    sandbox: E2bSandbox
    path: str
    recursive: bool
    last: Snapshot
    lock: anyio.Lock = field(default_factory=anyio.Lock)


def _runner(sandbox: E2bSandbox) -> SandboxRunnerClient:
    if sandbox.runner is None:
        raise ConnectError(Code.UNAVAILABLE, f"sandbox {sandbox.sandbox_id} is paused")
    return sandbox.runner


async def _call(
    sandbox: E2bSandbox, request: sm.FsRequest, *, busy_passes: bool = False
) -> sm.FsResult:
    """The runner's answer; its errors as envd's (``SessionBusyError`` as it is, when
    ``busy_passes``: a watch's poll skips a busy session instead of ending)."""
    try:
        return await _runner(sandbox).fs(request)
    except SandcellError as exc:
        if busy_passes and isinstance(exc, SessionBusyError):
            raise
        raise connect_error(exc) from None


async def _take(
    sandbox: E2bSandbox, path: str, recursive: bool, *, busy_passes: bool = False
) -> tuple[str, Snapshot]:
    stat = await _call(sandbox, sm.FsStat(path=path), busy_passes=busy_passes)
    assert stat.entry is not None
    if stat.entry.type != "dir":
        raise ConnectError(Code.INVALID_ARGUMENT, f"path {path[:200]!r} is not a directory")
    listed = await _call(
        sandbox, sm.FsSnapshot(path=path, recursive=recursive), busy_passes=busy_passes
    )
    return stat.entry.path, _snapshot(stat.entry.path, listed.entries or [])


class FilesystemService:
    """``filesystem.Filesystem`` over the runner's sandbox filesystem route."""

    def __init__(
        self, sandbox_of: SandboxOf, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._sandbox_of = sandbox_of
        self._clock = clock
        self._watchers: dict[str, _Watcher] = {}
        self._streams: collections.Counter[str] = collections.Counter()
        """Open ``WatchDir`` streams by tenant (``MAX_WATCH_STREAMS`` each)."""

    def _sandbox(self, ctx: Any) -> E2bSandbox:
        return self._sandbox_of(ctx)

    async def stat(
        self, request: pb.StatRequest, ctx: RequestContext[pb.StatRequest, pb.StatResponse], /
    ) -> pb.StatResponse:
        result = await _call(self._sandbox(ctx), sm.FsStat(path=request.path))
        assert result.entry is not None
        return pb.StatResponse(entry=_entry(result.entry))

    async def make_dir(
        self,
        request: pb.MakeDirRequest,
        ctx: RequestContext[pb.MakeDirRequest, pb.MakeDirResponse],
        /,
    ) -> pb.MakeDirResponse:
        result = await _call(self._sandbox(ctx), sm.FsMakeDir(path=request.path))
        assert result.entry is not None
        if not result.created:
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {request.path[:200]!r} exists")
        return pb.MakeDirResponse(entry=_entry(result.entry))

    async def move(
        self, request: pb.MoveRequest, ctx: RequestContext[pb.MoveRequest, pb.MoveResponse], /
    ) -> pb.MoveResponse:
        call = sm.FsMove(source=request.source, destination=request.destination)
        result = await _call(self._sandbox(ctx), call)
        assert result.entry is not None
        return pb.MoveResponse(entry=_entry(result.entry))

    async def list_dir(
        self,
        request: pb.ListDirRequest,
        ctx: RequestContext[pb.ListDirRequest, pb.ListDirResponse],
        /,
    ) -> pb.ListDirResponse:
        depth = max(1, int(request.depth))
        result = await _call(self._sandbox(ctx), sm.FsListDir(path=request.path, depth=depth))
        return pb.ListDirResponse(entries=[_entry(e) for e in result.entries or []])

    async def remove(
        self, request: pb.RemoveRequest, ctx: RequestContext[pb.RemoveRequest, pb.RemoveResponse], /
    ) -> pb.RemoveResponse:
        await _call(self._sandbox(ctx), sm.FsRemove(path=request.path))
        return pb.RemoveResponse()

    async def watch_dir(
        self,
        request: pb.WatchDirRequest,
        ctx: RequestContext[pb.WatchDirRequest, pb.WatchDirResponse],
        /,
    ) -> AsyncIterator[pb.WatchDirResponse]:
        sandbox = self._sandbox(ctx)
        owner = sandbox.owner
        if self._streams[owner] >= MAX_WATCH_STREAMS:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED,
                f"at most {MAX_WATCH_STREAMS} directory watches at once; stop one first",
            )
        self._streams[owner] += 1
        try:
            async for response in self._watch(sandbox, request):
                yield response
        finally:
            self._streams[owner] -= 1
            if self._streams[owner] <= 0:
                del self._streams[owner]

    async def _watch(
        self, sandbox: E2bSandbox, request: pb.WatchDirRequest
    ) -> AsyncIterator[pb.WatchDirResponse]:
        root, last = await _take(sandbox, request.path, request.recursive)
        yield pb.WatchDirResponse(event=_one("start", pb.WatchDirResponse.StartEvent()))
        quiet_since = self._clock()
        skipped = False
        while not sandbox.gone:
            await anyio.sleep(WATCH_POLL_S)
            try:
                _, now = await _take(sandbox, root, request.recursive, busy_passes=True)
            except SessionBusyError:
                # Another call held the session past the runner's wait: this poll
                # is skipped (the next one diffs against the same ``last``).
                if not skipped:
                    skipped = True
                    log.info(
                        "e2b watch of sandbox %s: a poll skipped, session busy", sandbox.sandbox_id
                    )
                now = last
            except ConnectError as exc:
                if exc.code is Code.NOT_FOUND:
                    return  # the watched directory went: the watch ends, as envd's does
                raise
            events = _diff(last, now)
            last = now
            for event in events:
                yield pb.WatchDirResponse(event=_one("filesystem", event))
            if events:
                quiet_since = self._clock()
            elif self._clock() - quiet_since >= WATCH_KEEPALIVE_S:
                quiet_since = self._clock()
                keepalive = pb.WatchDirResponse.KeepAlive()
                yield pb.WatchDirResponse(event=_one("keepalive", keepalive))

    async def create_watcher(
        self,
        request: pb.CreateWatcherRequest,
        ctx: RequestContext[pb.CreateWatcherRequest, pb.CreateWatcherResponse],
        /,
    ) -> pb.CreateWatcherResponse:
        sandbox = self._sandbox(ctx)
        self._watchers = {k: w for k, w in self._watchers.items() if not w.sandbox.gone}
        if sum(w.sandbox is sandbox for w in self._watchers.values()) >= MAX_WATCHERS:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS} watchers")
        root, last = await _take(sandbox, request.path, request.recursive)
        watcher_id = secrets.token_hex(12)
        self._watchers[watcher_id] = _Watcher(sandbox, root, request.recursive, last)
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    def _watcher(self, ctx: Any, watcher_id: str) -> _Watcher:
        sandbox = self._sandbox(ctx)
        watcher = self._watchers.get(watcher_id)
        if watcher is None or watcher.sandbox is not sandbox:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id[:40]!r} not found")
        return watcher

    async def get_watcher_events(
        self,
        request: pb.GetWatcherEventsRequest,
        ctx: RequestContext[pb.GetWatcherEventsRequest, pb.GetWatcherEventsResponse],
        /,
    ) -> pb.GetWatcherEventsResponse:
        watcher = self._watcher(ctx, request.watcher_id)
        async with watcher.lock:
            try:
                _, now = await _take(watcher.sandbox, watcher.path, watcher.recursive)
            except ConnectError as exc:
                if exc.code is not Code.NOT_FOUND:
                    raise
                now = {}
            events, watcher.last = _diff(watcher.last, now), now
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self,
        request: pb.RemoveWatcherRequest,
        ctx: RequestContext[pb.RemoveWatcherRequest, pb.RemoveWatcherResponse],
        /,
    ) -> pb.RemoveWatcherResponse:
        self._watcher(ctx, request.watcher_id)
        self._watchers.pop(request.watcher_id, None)
        return pb.RemoveWatcherResponse()


def filesystem_app(sandbox_of: SandboxOf) -> FilesystemASGIApplication:
    """The Connect ASGI app of ``filesystem.Filesystem``."""
    return FilesystemASGIApplication(FilesystemService(sandbox_of), codecs=strict_codecs())  # type: ignore[arg-type]
