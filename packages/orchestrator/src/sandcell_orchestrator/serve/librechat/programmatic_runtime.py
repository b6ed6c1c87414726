"""What runs inside the interpreter for programmatic tool calling, and tools' names there.

``RUNTIME`` is Python source (standard library only) that the first round of a
programmatic run executes in its code context; ``python_name`` is how a tool's
name becomes the async function the code calls (as ``@librechat/agents`` spells it).
``programmatic.py`` drives the rounds.
"""

from __future__ import annotations

import keyword
import re

__all__ = ["RUNTIME", "python_name"]

# The hard keywords only, as the client's list has them (``match`` stays ``match``:
# a soft keyword is a valid name); a parity test compares with the client.
_PY_KEYWORDS = frozenset(keyword.kwlist)

# Runs inside the context's interpreter (standard library only). The code becomes
# the body of an async function whose globals hold the tools; a tool call records
# {id, name, input} and awaits a future that the next round resolves.
RUNTIME = r"""
import asyncio as _sc_asyncio, itertools as _sc_it, json as _sc_json, sys as _sc_sys
import threading as _sc_threading, time as _sc_time, traceback as _sc_tb

class _SandcellAnswer:
    def __init__(self, value):
        self._value = _sc_json.dumps(value, default=str)
    def _repr_json_(self):
        return self._value
    def __repr__(self):
        return "<sandcell programmatic round>"

def _sandcell_decode(value):
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            return _sc_json.loads(value)
        except ValueError:
            return value
    return value

class _SandcellProgrammatic:
    def __init__(self, code, tools):
        self.loop = _sc_asyncio.new_event_loop()
        self.lock = _sc_threading.Lock()
        self.pending = {}
        self.new = []
        self.ids = _sc_it.count(1)
        self.last_call = 0.0
        space = {"__name__": "__main__", "asyncio": _sc_asyncio}
        for python, original in tools.items():
            space[python] = self._tool(original)
        body = "\n".join(("    " + line) if line.strip() else "" for line in code.split("\n"))
        source = "async def __sandcell_main__():\n" + body + "\n    pass\n"
        exec(compile(source, "<code>", "exec"), space)
        _sc_threading.Thread(target=self.loop.run_forever, name="sandcell-ptc", daemon=True).start()
        self.task = _sc_asyncio.run_coroutine_threadsafe(space["__sandcell_main__"](), self.loop)

    def _tool(self, name):
        async def tool(*args, **kwargs):
            if args:
                raise TypeError(name + "() takes keyword arguments only")
            future = self.loop.create_future()
            with self.lock:
                call_id = "call_%d" % next(self.ids)
                self.pending[call_id] = future
                self.new.append({"id": call_id, "name": name, "input": kwargs})
                self.last_call = _sc_time.monotonic()
            return await future
        tool.__name__ = name
        return tool

    def resume(self, results):
        for item in results:
            future = self.pending.pop(item.get("call_id"), None)
            if future is None:
                continue
            if item.get("is_error"):
                error = RuntimeError(item.get("error_message") or "the tool failed")
                self.loop.call_soon_threadsafe(future.set_exception, error)
            else:
                value = _sandcell_decode(item.get("result"))
                self.loop.call_soon_threadsafe(future.set_result, value)

    def wait(self, quiet_s):
        while True:
            if self.task.done():
                self.loop.call_soon_threadsafe(self.loop.stop)
                error = self.task.exception()
                if error is None:
                    return _SandcellAnswer({"state": "done"})
                text = "".join(_sc_tb.format_exception(type(error), error, error.__traceback__))
                _sc_sys.stderr.write(text)
                message = type(error).__name__ + ": " + str(error)
                return _SandcellAnswer({"state": "error", "error": message})
            with self.lock:
                if self.new and _sc_time.monotonic() - self.last_call >= quiet_s:
                    calls, self.new = self.new, []
                    return _SandcellAnswer({"state": "calls", "calls": calls})
            _sc_time.sleep(0.01)
"""


def python_name(name: str) -> str:
    """A tool's name as the code calls it, as ``@librechat/agents`` normalizes it:
    hyphens and spaces to ``_``, other characters dropped, a leading digit prefixed
    with ``_``, a keyword suffixed with ``_tool``."""
    normalized = re.sub(r"[^a-zA-Z0-9_]", "", re.sub(r"[-\s]", "_", name))
    if re.match(r"[0-9]", normalized):
        normalized = "_" + normalized
    if normalized in _PY_KEYWORDS:
        normalized += "_tool"
    return normalized
