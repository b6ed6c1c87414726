"""The Python context driver: a notebook-like interpreter loop, run inside the jail.

This file is copied into the context's job directory and run by the jail's own
``python3 -I`` (standard library only: the jail has no runner packages). It is
PID 1 of the jail's pid namespace.

Why our own driver and not ipykernel + a Jupyter client: a kernel needs ZeroMQ
sockets (five of them, plus a connection file with an HMAC key in the workspace),
pulls IPython, tornado and pyzmq into every context (~150 ms and ~60 MiB before
the first cell), and its messages would still have to be translated to ours. A
driver of a few hundred lines over two pipes needs no socket at all, so the jail
keeps its seccomp policy and network rules unchanged, and every byte it sends is
already in our own event shapes.

Wire (both directions): frames of a 4-byte big-endian length and a UTF-8 JSON
object. The runner sends ``{"op": "run", "code", "env"}`` on fd 0 (and, after a
cell that timed out, ``{"op": "reap"}``: everything the cell left running is
killed), and closes it to end the driver. The driver sends, on fd 1: ``ready``;
then per run ``stdout``, ``stderr``, ``result``, ``error`` frames and one ``end``.
The runner treats every frame as untrusted (the cell's code can reach these
descriptors too).

Interrupts are SIGINT sent by the runner to this process directly (nsjail's own
forwarding repeats a signal every second until the job ends, which is no use for
an interrupt that should leave the interpreter alive). The handler raises
``KeyboardInterrupt`` only while the cell's code runs; one arriving while a frame
is being written is held until the frame is complete, so a frame is never cut.
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import io
import json
import linecache
import os
import resource
import select
import signal
import struct
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct(">I")
_TEXT_PLAIN_MAX = 1 << 20
_REPRS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
    ("_repr_javascript_", "application/javascript"),
)
_BINARY = ("image/png", "image/jpeg")
_MIMES = {mime for _, mime in _REPRS} | {"text/plain"}


class _Interrupts:
    """Whether a SIGINT may raise now, and one that arrived while it could not."""

    def __init__(self) -> None:
        self.allowed = False
        self.pending = False

    def handler(self, signum: int, frame: types.FrameType | None) -> None:
        if self.allowed:
            raise KeyboardInterrupt
        self.pending = True

    def reopen(self) -> None:
        """Allow interrupts again, raising one that came in meanwhile."""
        self.allowed = True
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


class Channel:
    """Frames in from the runner, frames out to it (one writer at a time)."""

    def __init__(self, cmd_fd: int, evt_fd: int, interrupts: _Interrupts) -> None:
        self._cmd = cmd_fd
        self._evt = evt_fd
        self._interrupts = interrupts
        self.lock = threading.RLock()
        self.forwarder: FdForwarder | None = None

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, ensure_ascii=False, default=str).encode("utf-8", "replace")
        frame = _HEADER.pack(len(data)) + data
        with self.lock:
            allowed = self._interrupts.allowed
            self._interrupts.allowed = False
            try:
                view = memoryview(frame)
                while view:
                    view = view[os.write(self._evt, view) :]
            finally:
                if allowed and threading.current_thread() is threading.main_thread():
                    self._interrupts.reopen()
                elif allowed:
                    self._interrupts.allowed = True

    def _read_exact(self, size: int) -> bytes | None:
        chunks: list[bytes] = []
        while size:
            chunk = os.read(self._cmd, min(size, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def receive(self) -> dict[str, Any] | None:
        header = self._read_exact(_HEADER.size)
        if header is None:
            return None
        body = self._read_exact(_HEADER.unpack(header)[0])
        if body is None:
            return None
        message: dict[str, Any] = json.loads(body)
        return message


class FrameStream(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr``: text as frames, a line at a time."""

    def __init__(self, channel: Channel, name: str, fd: int) -> None:
        self._channel = channel
        self._name = name
        self._fd = fd
        self._parts: list[str] = []
        self._size = 0

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._parts.append(text)
        self._size += len(text)
        if "\n" in text or self._size > 8192:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self._parts:
            text = "".join(self._parts)
            self._parts.clear()
            self._size = 0
            with self._channel.lock:
                # What a finished subprocess wrote comes first, as it did on a terminal.
                if self._channel.forwarder is not None:
                    self._channel.forwarder.drain()
                self._channel.send({"t": self._name, "data": text})


class FdForwarder:
    """Output written to fds 1 and 2 (subprocesses, C code) forwarded as frames."""

    def __init__(self, channel: Channel, fds: dict[int, str]) -> None:
        self._channel = channel
        self._fds = fds
        for fd in fds:
            os.set_blocking(fd, False)
        threading.Thread(target=self._loop, name="sandcell-fds", daemon=True).start()

    def _loop(self) -> None:
        fds = list(self._fds)
        while fds:
            ready, _, _ = select.select(fds, [], [])
            for fd in ready:
                if not self._read(fd):
                    fds.remove(fd)

    def _read(self, fd: int) -> bool:
        with self._channel.lock:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if data:
                self._channel.send({"t": self._fds[fd], "data": data.decode("utf-8", "replace")})
            return bool(data)

    def drain(self) -> None:
        """Forward whatever is waiting (before a run's end is sent)."""
        with self._channel.lock:
            for fd, name in self._fds.items():
                while True:
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    if not data:
                        break
                    self._channel.send({"t": name, "data": data.decode("utf-8", "replace")})


def _b64(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode("ascii")
    return str(value)


def _figure_png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _is_figure(value: Any) -> bool:
    figure_module = sys.modules.get("matplotlib.figure")
    figure_type = getattr(figure_module, "Figure", None)
    return figure_type is not None and isinstance(value, figure_type)


def mimebundle(value: Any) -> dict[str, Any]:
    """Every representation ``value`` offers, richest first, plus ``text/plain``."""
    data: dict[str, Any] = {}
    bundle_method = getattr(value, "_repr_mimebundle_", None)
    if callable(bundle_method) and not isinstance(value, type):
        try:
            bundle = bundle_method()
            if isinstance(bundle, tuple):
                bundle = bundle[0]
            if isinstance(bundle, dict):
                for mime, item in bundle.items():
                    if mime in _MIMES and item is not None:
                        data[mime] = _b64(item) if mime in _BINARY else item
        except Exception:  # noqa: S110 - a broken repr must not break the cell
            pass
    if not isinstance(value, type):
        for method_name, mime in _REPRS:
            if mime in data:
                continue
            method = getattr(value, method_name, None)
            if not callable(method):
                continue
            try:
                item = method()
            except Exception:  # noqa: S112 - nor may one representation
                continue
            if isinstance(item, tuple):
                item = item[0]
            if item is None:
                continue
            data[mime] = _b64(item) if mime in _BINARY else item
        if "image/png" not in data and _is_figure(value):
            data["image/png"] = _b64(_figure_png(value))
    if "text/plain" not in data:
        try:
            text = repr(value)
        except Exception as exc:
            text = f"<repr failed: {type(exc).__name__}: {exc}>"
        data["text/plain"] = text[:_TEXT_PLAIN_MAX]
    if "application/json" in data and isinstance(data["application/json"], str):
        try:
            data["application/json"] = json.loads(data["application/json"])
        except ValueError:
            del data["application/json"]
    return data


class Kernel:
    """The interpreter state of one context: its namespace and its execution count."""

    def __init__(self, channel: Channel, fds: FdForwarder, interrupts: _Interrupts) -> None:
        self.channel = channel
        self.fds = fds
        self.interrupts = interrupts
        self.count = 0
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        self.namespace = main.__dict__
        self.shown: set[int] = set()
        display: Callable[..., None] = self.display
        builtins.display = display  # type: ignore[attr-defined]
        self.namespace["display"] = display

    def display(self, *values: Any, raw: bool = False, **_: Any) -> None:
        """``display(obj, ...)``: each value's representations as a result (not main)."""
        for value in values:
            if raw and isinstance(value, dict):
                self._result({k: v for k, v in value.items() if k in _MIMES}, main=False)
            else:
                self._show(value, main=False)

    def _show(self, value: Any, *, main: bool) -> None:
        if _is_figure(value):
            self.shown.add(id(value))
        self._result(mimebundle(value), main=main)

    def _result(self, data: dict[str, Any], *, main: bool) -> None:
        _flush_streams()
        self.channel.send({"t": "result", "data": data, "main": main})

    def run(self, code: str, env: dict[str, str]) -> None:
        self.count += 1
        filename = f"<cell-{self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        before = _cpu_s()
        status = "ok"
        self.shown = set()
        try:
            self.interrupts.pending = False
            self.interrupts.reopen()
            try:
                self._execute(code, filename)
                self._flush_figures()
            finally:
                self.interrupts.allowed = False
        except BaseException as exc:  # every exception is the cell's
            status = "error"
            self.interrupts.allowed = False
            self._error(exc)
        finally:
            self.interrupts.allowed = False
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old
            _flush_streams()
            self.fds.drain()
            cpu_ms = int((_cpu_s() - before) * 1000)
            self.channel.send({"t": "end", "status": status, "count": self.count, "cpu_ms": cpu_ms})

    def _execute(self, code: str, filename: str) -> None:
        tree = ast.parse(code, filename=filename, mode="exec")
        last: ast.expr | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = tree.body.pop().value  # type: ignore[attr-defined]
        if tree.body:
            exec(compile(tree, filename, "exec"), self.namespace)  # noqa: S102 - the cell
        if last is not None:
            expression = ast.Expression(body=last)
            value = eval(compile(expression, filename, "eval"), self.namespace)  # noqa: S307
            if value is not None:
                self.namespace["_"] = value
                self._show(value, main=True)

    def _flush_figures(self) -> None:
        """Figures the cell left open, as PNGs (like a notebook's inline backend)."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            for number in pyplot.get_fignums():
                figure = pyplot.figure(number)
                if id(figure) not in self.shown:
                    data = {"image/png": _b64(_figure_png(figure)), "text/plain": repr(figure)}
                    self._result(data, main=False)
        finally:
            pyplot.close("all")

    def _error(self, exc: BaseException) -> None:
        # The driver's own frames (its exec, its SIGINT handler) are not the user's business.
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        for part in _chain(report):
            kept = [frame for frame in part.stack if frame.filename != __file__]
            part.stack = traceback.StackSummary.from_list(kept)
        lines = list(report.format())
        _flush_streams()
        self.channel.send(
            {
                "t": "error",
                "name": type(exc).__name__,
                "value": str(exc),
                "traceback": "".join(lines),
            }
        )


def _chain(report: traceback.TracebackException) -> list[traceback.TracebackException]:
    parts: list[traceback.TracebackException] = []
    todo = [report]
    while todo and len(parts) < 100:
        part = todo.pop()
        parts.append(part)
        todo += [p for p in (part.__cause__, part.__context__) if p is not None]
    return parts


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def reap() -> None:
    """After a timeout: end every other process of the jail (what the cell started).

    Only as PID 1 of the jail's pid namespace, where ``kill(-1)`` reaches that
    namespace alone; unjailed it would reach every process of the user.
    """
    if os.getpid() != 1:
        return
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def _redirect(fd: int) -> int:
    """Point ``fd`` at a new pipe; return the pipe's read end."""
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)
    return read_end


def main() -> None:
    cwd = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    interrupts = _Interrupts()
    signal.signal(signal.SIGINT, interrupts.handler)
    # The runner's pipes move off 0 and 1, so the cell's input() reads nothing and
    # the output of a subprocess it starts comes back through the forwarder.
    cmd_fd = os.dup(0)
    evt_fd = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out_r, err_r = _redirect(1), _redirect(2)
    channel = Channel(cmd_fd, evt_fd, interrupts)
    forwarder = FdForwarder(channel, {out_r: "stdout", err_r: "stderr"})
    channel.forwarder = forwarder
    sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 - lives as long as we do
    sys.stdout = FrameStream(channel, "stdout", 1)
    sys.stderr = FrameStream(channel, "stderr", 2)
    os.chdir(cwd)
    sys.path.insert(0, "")
    sys.argv = [""]
    warnings.filterwarnings("ignore", message=".*non-GUI backend.*")
    warnings.filterwarnings("ignore", message=".*is non-interactive, and thus cannot be shown")
    kernel = Kernel(channel, forwarder, interrupts)
    channel.send({"t": "ready", "version": sys.version.split()[0]})
    while True:
        try:
            message = channel.receive()
        except KeyboardInterrupt:
            continue  # an interrupt between runs interrupts nothing
        if message is None:
            break
        if message.get("op") == "run":
            env = {str(k): str(v) for k, v in dict(message.get("env") or {}).items()}
            kernel.run(str(message.get("code", "")), env)
        elif message.get("op") == "reap":
            reap()
    os._exit(0)


if __name__ == "__main__":
    main()
