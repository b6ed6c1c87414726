"""One context's interpreter state: its namespace, its runs and their results."""

from __future__ import annotations

import ast
import builtins
import contextlib
import linecache
import os
import resource
import sys
import traceback
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .channel import Channel, FdForwarder, Interrupts
from .display import MIMES, b64, figure_png, is_figure, mimebundle

if TYPE_CHECKING:
    from .ipython import Shell

__all__ = ["Kernel", "flush_streams"]


class Kernel:
    """The interpreter state of one context: its namespace and its execution count."""

    def __init__(
        self,
        channel: Channel,
        fds: FdForwarder,
        interrupts: Interrupts,
        *,
        hidden: tuple[str, ...],
    ) -> None:
        self.channel = channel
        self.hidden = hidden
        """Path prefixes of the driver's own files, whose frames a traceback leaves out."""
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
        self.ipython: Shell | None = None
        """IPython's shell, from the first cell that is not Python (``!cmd``, ``%magic``)."""

    def display(self, *values: Any, raw: bool = False, **_: Any) -> None:
        """``display(obj, ...)``: each value's representations as a result (not main)."""
        for value in values:
            if raw and isinstance(value, dict):
                self._result({k: v for k, v in value.items() if k in MIMES}, main=False)
            else:
                self._show(value, main=False)

    def _show(self, value: Any, *, main: bool) -> None:
        if is_figure(value):
            self.shown.add(id(value))
        self._result(mimebundle(value), main=main)

    def _result(self, data: dict[str, Any], *, main: bool) -> None:
        flush_streams()
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
            # An interrupt that came since the runner sent this run (while the frame was
            # read, before the cell began) is this run's: reopen raises it. Only what
            # came after the last run ended is stale, and that was dropped at its end.
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
            self.interrupts.pending = False
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old
            flush_streams()
            self.fds.drain()
            cpu_ms = int((_cpu_s() - before) * 1000)
            self.channel.send({"t": "end", "status": status, "count": self.count, "cpu_ms": cpu_ms})

    def _parse(self, code: str, filename: str) -> ast.Module:
        """The cell as Python: itself, or what IPython makes of ``!cmd`` and magics."""
        try:
            return ast.parse(code, filename=filename, mode="exec")
        except SyntaxError as exc:
            error = exc
        if self.ipython is None:
            # Imported here: compiling it costs every context's start-up a millisecond.
            from .ipython import Shell

            self.ipython = Shell(self.namespace, lambda data: self._result(data, main=False))
        transformed = self.ipython.transform(code)
        if transformed is not None and transformed != code:
            with contextlib.suppress(SyntaxError):
                tree = ast.parse(transformed, filename=filename, mode="exec")
                # Tracebacks quote the Python that ran, line for line (as IPython's do).
                lines = transformed.splitlines(True)
                linecache.cache[filename] = (len(transformed), None, lines, filename)
                return tree
        # The cell's own mistake: its frames (ast's, the driver's) are not the user's.
        raise error.with_traceback(None)

    def _execute(self, code: str, filename: str) -> None:
        tree = self._parse(code, filename)
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
                    data = {"image/png": b64(figure_png(figure)), "text/plain": repr(figure)}
                    self._result(data, main=False)
        finally:
            pyplot.close("all")

    def _error(self, exc: BaseException) -> None:
        # The driver's own frames (its exec, its SIGINT handler) are not the user's business.
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        hidden = self.hidden + (self.ipython.hidden if self.ipython is not None else ())
        for part in _chain(report):
            kept = [frame for frame in part.stack if not frame.filename.startswith(hidden)]
            part.stack = traceback.StackSummary.from_list(kept)
        lines = list(report.format())
        flush_streams()
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


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
