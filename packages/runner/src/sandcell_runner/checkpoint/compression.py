"""Checkpoint stream codecs: gzip or zstd, streaming both ways with bounded memory.

Compression is tuned for speed (a checkpoint sits on the turn's critical path):
gzip through ISA-L (``isal``) at level 1, zstd level 3 on one thread. Decompression runs in a
thread at most 4 MiB ahead and never hands out more bytes than its caller
allowed, so a compression bomb costs at most that pool of memory, and it
rejects truncated streams and bytes after the end of the stream (a gzip CRC or
a zstd checksum is only worth something if the stream is known to have reached it).
"""

from __future__ import annotations

import mmap
import queue
import threading
from collections.abc import Callable
from typing import IO, Literal, Protocol, cast

import zstandard
from isal import isal_zlib

from ..errors import ArchiveRejectedError

Encoding = Literal["gzip", "zstd"]

GZIP_LEVEL = 1
"""ISA-L's level 1: zlib level 1's ratio here at ~4x its speed (437 vs 117 MB/s on CSV,
294 vs 42 MB/s on random bytes); gzip is the fallback every peer reads, and at
zlib's speed it was the slowest stage of a checkpoint. isal releases the GIL as
zlib does."""
ZSTD_LEVEL = 3
ZSTD_THREADS = 0
"""Single-threaded: zstd's multithreaded mode buffers whole jobs until a flush, which
grew the runner's RSS by ~180 MiB on a 256 MiB workspace; one thread at level 3
still compresses ~400 MB/s here, outside the GIL."""
ZSTD_MAX_WINDOW_BYTES = 8 << 20
"""Levels 1-3 use windows of 1-4 MiB; a frame asking for more is hostile."""

# Large chunks keep the per-chunk Python work (a frame-tracker pass, a slice, a
# write) small next to the bytes moved; the decompressors themselves run at GB/s.
# gzip reads less at a time: zlib copies the unconsumed rest of its input into
# a new bytes object on every call, and that copy grows with the read.
_ZSTD_RAW_READ_BYTES = 256 << 10
_GZIP_RAW_READ_BYTES = 64 << 10
_AHEAD_CHUNK_BYTES = 1 << 20
_AHEAD_CHUNKS = 4
# isal's stub declares its error class as an instance of Exception.
_ISAL_ERROR = cast(type[Exception], isal_zlib.error)
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_MAX_BLOCK_BYTES = 128 << 10


def choose_encoding(accept_encoding: str | None) -> Encoding:
    """Pick ``zstd`` when ``Accept-Encoding`` lists it with a non-zero q-value, else ``gzip``."""
    for item in (accept_encoding or "").split(","):
        token, *params = (part.strip() for part in item.split(";"))
        if token.lower() != "zstd":
            continue
        q_value = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q_value = float(value)
                except ValueError:
                    q_value = 0.0
        if q_value > 0:
            return "zstd"
    return "gzip"


def sniff_encoding(first: bytes) -> Encoding:
    """The archive's compression from its magic bytes (the body is untrusted)."""
    if first.startswith(_GZIP_MAGIC):
        return "gzip"
    if first.startswith(_ZSTD_MAGIC):
        return "zstd"
    raise ArchiveRejectedError("archive is neither gzip nor zstd")


class Compressor(Protocol):
    """The part of ``zlib.compressobj`` / ``ZstdCompressionObj`` this package uses."""

    def compress(self, data: bytes, /) -> bytes: ...

    def flush(self) -> bytes: ...


def new_compressor(encoding: Encoding) -> Compressor:
    """A fresh streaming compressor producing one gzip member or one zstd frame."""
    if encoding == "gzip":
        # wbits=31: a gzip wrapper (header + CRC32), not a bare zlib stream.
        return isal_zlib.compressobj(GZIP_LEVEL, isal_zlib.DEFLATED, 31)
    compressor = zstandard.ZstdCompressor(
        level=ZSTD_LEVEL, threads=ZSTD_THREADS, write_checksum=True
    )
    return cast(Compressor, compressor.compressobj())


RawSource = Callable[[int], bytes]
"""``read(n)`` of the compressed bytes: up to ``n`` bytes, ``b""`` only at the end."""


class DecompressingReader:
    """``read(n)`` over a compressed source, for the extractor's tar parser.

    ``limit`` is the absolute number of decompressed bytes this reader may hand
    out; the caller raises it phase by phase (a header, a member's data) so that
    a lying header or a bomb fails here, not after filling memory or disk.
    """

    def __init__(self, source: RawSource, *, encoding: Encoding) -> None:
        inflater: _GzipInflater | _ZstdInflater = (
            _GzipInflater(source) if encoding == "gzip" else _ZstdInflater(source)
        )
        self._ahead = _ReadAhead(inflater)
        self.delivered = 0
        self.limit = 0

    @staticmethod
    def prewarm() -> None:
        """Make (and drop) each decompressor once: their first set-up costs more."""
        zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW_BYTES)
        isal_zlib.decompressobj(31)

    def allow(self, extra_bytes: int) -> None:
        """Let the reader hand out ``extra_bytes`` more than it has so far."""
        self.limit = self.delivered + extra_bytes

    def read(self, size: int) -> memoryview:
        """Up to ``size`` decompressed bytes; empty once the stream ended cleanly.

        A view, not a copy, valid until the next ``read`` (the buffer under it
        may be reused): a member's data goes from the decompressor to
        ``os.write`` without passing through another buffer.
        """
        size = min(size, self.limit - self.delivered)
        if size <= 0:
            raise ArchiveRejectedError(
                "archive metadata or data exceeds what its headers allow (decompression bomb?)"
            )
        data = self._ahead.read(size)
        self.delivered += len(data)
        return data


class _ReadAhead:
    """An inflater run by a thread, at most ``_AHEAD_CHUNKS`` MiB ahead of the reader.

    zlib and zstd release the GIL while they decompress (and ``os.read`` while it
    waits), so the next chunk is inflated while the extractor parses and writes
    this one. Memory stays bounded by the chunk pool; the caller's limits are
    still enforced on what is handed out, so a bomb costs at most the pool. A
    stream error is raised by the ``read`` that reaches it.
    """

    def __init__(self, inflater: _GzipInflater | _ZstdInflater) -> None:
        self._inflater = inflater
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for _ in range(_AHEAD_CHUNKS):
            # Anonymous maps, not bytearrays: bytearray(n) zero-fills, touching
            # all 4 MiB (~3 CPU-ms, most of a small restore's extraction); a map's
            # pages are faulted in only where data lands, once.
            self._free.put(mmap.mmap(-1, _AHEAD_CHUNK_BYTES))
        self._ready: queue.SimpleQueue[tuple[mmap.mmap, int] | BaseException] = queue.SimpleQueue()
        self._chunk: mmap.mmap | None = None
        self._start = 0
        self._end = 0
        self._finished = False
        # A daemon: a rejected archive ends the process without draining the stream.
        threading.Thread(target=self._inflate, name="sandcell-inflate", daemon=True).start()

    def _inflate(self) -> None:
        try:
            while True:
                chunk = self._free.get()
                filled = self._inflater.readinto(memoryview(chunk))
                self._ready.put((chunk, filled))
                if not filled:
                    return
        except BaseException as exc:  # handed to the reader, raised there
            self._ready.put(exc)

    def read(self, size: int) -> memoryview:
        """Up to ``size`` bytes of the current chunk; the next chunk once it is used up."""
        if self._start == self._end:
            if self._chunk is not None:
                self._free.put(self._chunk)  # the caller is done with the last view
                self._chunk = None
            if self._finished:
                return memoryview(b"")
            item = self._ready.get()
            if isinstance(item, BaseException):
                self._finished = True
                raise item
            chunk, filled = item
            if not filled:
                self._finished = True
                return memoryview(b"")
            self._chunk, self._start, self._end = chunk, 0, filled
        assert self._chunk is not None
        taken = min(size, self._end - self._start)
        view = memoryview(self._chunk)[self._start : self._start + taken]
        self._start += taken
        return view


class _GzipInflater:
    def __init__(self, source: RawSource) -> None:
        self._source = source
        # ISA-L inflates about twice as fast as zlib, same API (and limits).
        self._inflate = isal_zlib.decompressobj(31)
        self._pending = b""
        self._ended = False

    def readinto(self, view: memoryview) -> int:
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def read(self, size: int) -> memoryview:
        while True:
            if self._inflate.eof:
                self._check_end()
                return memoryview(b"")
            if not self._pending:
                self._pending = self._source(_GZIP_RAW_READ_BYTES)
                if not self._pending:
                    raise ArchiveRejectedError("gzip: stream truncated")
            try:
                out = self._inflate.decompress(self._pending, size)
            except _ISAL_ERROR as exc:
                raise ArchiveRejectedError(f"gzip: corrupt stream ({exc})") from None
            self._pending = self._inflate.unconsumed_tail
            if out:
                return memoryview(out)

    def _check_end(self) -> None:
        if self._ended:
            return
        # A second gzip member or any other trailer is refused: an exporter
        # writes exactly one member, and bytes no one checks have no business here.
        if self._inflate.unused_data or self._source(1):
            raise ArchiveRejectedError("gzip: data after the end of the stream")
        self._ended = True


class _ZstdInflater:
    def __init__(self, source: RawSource) -> None:
        self._source = _TrackedSource(source)
        decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW_BYTES)
        self._reader = decompressor.stream_reader(
            cast(IO[bytes], self._source),
            read_size=_ZSTD_RAW_READ_BYTES,
            read_across_frames=False,
            closefd=False,
        )
        self._ended = False

    def readinto(self, view: memoryview) -> int:
        # Into the caller's (reused) buffer: a fresh 1 MiB bytes object per chunk
        # is mmap'ed and page-faulted anew each time, ~20% of a restore.
        if self._ended:
            return 0
        try:
            filled: int = self._reader.readinto(view)
        except zstandard.ZstdError as exc:
            raise ArchiveRejectedError(f"zstd: corrupt stream ({exc})") from None
        if not filled:
            self._finish()
        return filled

    def _finish(self) -> None:
        # The reader stops quietly at the end of its input, complete frame or
        # not, and may stop at the frame's end without reading what follows.
        self._source.read(1)
        if not self._source.frame.done:
            raise ArchiveRejectedError("zstd: stream truncated")
        self._ended = True


class _TrackedSource:
    """zstandard's view of the compressed bytes: each one passes the frame tracker."""

    def __init__(self, source: RawSource) -> None:
        self._source = source
        self.frame = _ZstdFrameTracker()

    def read(self, size: int) -> bytes:
        data = self._source(size)
        self.frame.feed(data)
        return data


class _ZstdFrameTracker:
    """Follows one zstd frame's block structure to know where it ends.

    Only the framing is checked here (magic, header size, block headers,
    checksum presence); the decoder checks the content. Skippable frames, a
    second frame and dictionaries are refused: the exporter never writes them.
    """

    def __init__(self) -> None:
        self._state = "magic"
        self._need = 4
        self._acc = bytearray()
        self._skip = 0
        self._last_block = False
        self._has_checksum = False
        self.done = False

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.done:
                raise ArchiveRejectedError("zstd: data after the end of the frame")
            if self._skip:
                taken = min(self._skip, len(view))
                view = view[taken:]
                self._skip -= taken
                if not self._skip:
                    self._after_block()
                continue
            taken = min(self._need - len(self._acc), len(view))
            self._acc += view[:taken]
            view = view[taken:]
            if len(self._acc) == self._need:
                field = bytes(self._acc)
                self._acc.clear()
                self._advance(field)

    def _advance(self, field: bytes) -> None:
        if self._state == "magic":
            if field != _ZSTD_MAGIC:
                raise ArchiveRejectedError("zstd: not a zstd frame")
            self._expect("descriptor", 1)
        elif self._state == "descriptor":
            descriptor = field[0]
            if descriptor & 0x08:
                raise ArchiveRejectedError("zstd: reserved frame header bit set")
            if descriptor & 0x03:
                raise ArchiveRejectedError("zstd: dictionaries are not used")
            single_segment = bool(descriptor & 0x20)
            self._has_checksum = bool(descriptor & 0x04)
            content_size_bytes = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
            rest = content_size_bytes + (0 if single_segment else 1)
            if rest:
                self._expect("header", rest)
            else:
                self._expect("block", 3)
        elif self._state == "header":
            self._expect("block", 3)
        elif self._state == "block":
            header = int.from_bytes(field, "little")
            self._last_block = bool(header & 1)
            block_type = (header >> 1) & 3
            block_size = header >> 3
            if block_type == 3 or block_size > _ZSTD_MAX_BLOCK_BYTES:
                raise ArchiveRejectedError("zstd: invalid block header")
            self._skip = 1 if block_type == 1 else block_size
            if not self._skip:
                self._after_block()
        else:  # checksum
            self.done = True

    def _after_block(self) -> None:
        if not self._last_block:
            self._expect("block", 3)
        elif self._has_checksum:
            self._expect("checksum", 4)
        else:
            self.done = True

    def _expect(self, state: str, size: int) -> None:
        self._state = state
        self._need = size
