"""Finds Python tracebacks and Node stack traces in a process's output, line by line.

Python prints the frames first and the exception last::

    Traceback (most recent call last):
      File "/mnt/data/app.py", line 9, in handler
        total = price * qty
    TypeError: unsupported operand type(s) for *: 'NoneType' and 'int'

(a script's own ``SyntaxError`` comes without the ``Traceback`` line: just the
``File`` line, the source and a caret). Node prints the exception first and the
frames after, one ``at`` per line; an ``Error: …`` line counts only when an
``at`` line follows it, so ordinary log lines that mention errors are not taken
for one. Each error is emitted as soon as its type and top frame are known.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..languages import WORKSPACE_DIR
from .runtime_errors import ErrorEvent, frame_location

_PY_START_RE = re.compile(r"Traceback \(most recent call last\):\s*$")
_PY_FILE_RE = re.compile(r'^\s+File "([^"]+)", line (\d+)(?:, in (.+))?\s*$')
_PY_BARE_FILE_RE = re.compile(r'^  File "([^"]+)", line (\d+)\s*$')
_PY_EXC_RE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
_NODE_HEAD_RE = re.compile(
    r"^(?:Uncaught\s+)?((?:[A-Z][\w$]*)?(?:Error|Exception))(?:\s*\[[\w-]+\])?(?::\s?(.*))?$"
)
_NODE_AT_RE = re.compile(r"^\s+at\s+\S")
_MAX_TRACE_LINES = 500

Frame = tuple[str, int, str | None]


def _relative(path: str) -> str:
    prefix = WORKSPACE_DIR + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


class TraceScanner:
    """Feed it lines; it calls ``emit`` once per error found."""

    def __init__(self, source: str, emit: Callable[[ErrorEvent], None]) -> None:
        self._source = source
        self._emit = emit
        self._py_frames: list[Frame] | None = None
        self._py_lines = 0
        self._node_head: tuple[str, str] | None = None
        self._node_in_frames = False

    def feed(self, line: str) -> None:
        if self._py_frames is not None:
            self._python_line(line)
            return
        if self._node_in_frames:
            if _NODE_AT_RE.match(line):
                return
            self._node_in_frames = False
        if self._node_head is not None:
            head, self._node_head = self._node_head, None
            if _NODE_AT_RE.match(line):
                self._emit_node(head, line)
                self._node_in_frames = True
                return
        if _PY_START_RE.search(line):
            self._py_frames, self._py_lines = [], 0
            return
        if match := _PY_BARE_FILE_RE.match(line):
            self._py_frames, self._py_lines = [], 0
            self._python_line(line)
            return
        if match := _NODE_HEAD_RE.match(line.strip()):
            self._node_head = (match.group(1), match.group(2) or "")

    # -- Python ---------------------------------------------------------------

    def _python_line(self, line: str) -> None:
        frames = self._py_frames
        if frames is None:
            return
        self._py_lines += 1
        if self._py_lines > _MAX_TRACE_LINES:
            self._py_frames = None
            return
        if not line.strip():
            return
        if line[:1].isspace():
            if match := _PY_FILE_RE.match(line):
                frames.append((match.group(1), int(match.group(2)), match.group(3)))
            return
        self._py_frames = None
        match = _PY_EXC_RE.match(line.strip())
        if match is None or not frames:
            return
        self._emit_python(match.group(1), match.group(2) or "", frames)

    def _emit_python(self, type_name: str, message: str, frames: list[Frame]) -> None:
        innermost = frames[-1]
        own = [f for f in frames if f[0].startswith(WORKSPACE_DIR + "/")]
        where = own[-1] if own else innermost
        file, line, func = innermost
        top = f'File "{_relative(file)}", line {line}' + (f", in {func}" if func else "")
        self._emit(
            ErrorEvent(
                type=type_name,
                message=message.strip(),
                source=self._source,
                file=_relative(where[0]),
                line=where[1],
                column=None,
                top_frame=top,
            )
        )

    # -- Node -------------------------------------------------------------------

    def _emit_node(self, head: tuple[str, str], frame_line: str) -> None:
        type_name, message = head
        frame = frame_line.strip()
        where = frame_location(frame)
        file = line = column = None
        if where is not None:
            file, line, column = _relative(where[0]), where[1], where[2]
        self._emit(
            ErrorEvent(
                type=type_name,
                message=message.strip(),
                source=self._source,
                file=file,
                line=line,
                column=column,
                top_frame=frame.replace(WORKSPACE_DIR + "/", ""),
            )
        )


__all__ = ["TraceScanner"]
