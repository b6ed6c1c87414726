"""What runs inside the interpreter for programmatic tool calling, and tools' names there.

``RUNTIME`` is Python source (standard library only) that the first round of a
programmatic run executes in its code context; ``python_name`` is how a tool's
name becomes the async function the code calls (as ``@librechat/agents`` spells it).
``BASH_RUNTIME`` (after ``RUNTIME``) runs ``lang: "bash"`` code, the client's bash
programmatic tool: a ``bash`` child of the context's interpreter in which each tool is
a shell function (named by ``bash_name``) taking one JSON string argument; a call
leaves its request in a file, names it on a pipe, and blocks on a FIFO the next round
writes its result to. ``programmatic.py`` drives the rounds.
"""

from __future__ import annotations

import keyword
import re

__all__ = ["BASH_RUNTIME", "RUNTIME", "bash_name", "python_name"]

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


# The shell side of a tool call. Each tool is a function named by ``bash_name``, so any
# word of that shape may be one (``cat``, ``read``, ``printf``, ``builtin``, ``command``,
# ``break``, ...), and bash looks functions up before builtins: a helper calling such a
# word called the tool instead (eight such tools "completed" with every result empty,
# ``mkfifo`` recursed until bash crashed). So the helper is named with a ``-`` (which no
# ``bash_name`` has) and uses only what no function can shadow: reserved words and
# ``[[ ]]``, the words ``bash_name`` suffixes (``local``, ``readonly``; no ``return``,
# no ``break``), assignments, redirections, ``$(<file)`` (bash reads the file itself,
# no command), and programs by the absolute paths found before any tool was defined.
# The request (the tool's bash name, a newline, the argument as given, a newline) goes
# in a file beside the reply FIFO, and only the FIFO's path on the pipe, so calls from
# background jobs never interleave on it; the reply is the result in a file beside it,
# then "ok" or "error" on the FIFO (the result goes to stdout, the message to stderr).
_BASH_PRELUDE = r"""
readonly _sc_ptc_cat="$(type -P cat)" _sc_ptc_mkfifo="$(type -P mkfifo)" _sc_ptc_rm="$(type -P rm)"
sc-ptc-call() {
  local _sc_fifo="" _sc_status=error _sc_tries=0
  while [[ -z $_sc_fifo ]] && (( _sc_tries++ < 100 )); do
    _sc_fifo="$SC_PTC_DIR/r.$BASHPID.$RANDOM$RANDOM"
    "$_sc_ptc_mkfifo" -m 600 -- "$_sc_fifo" 2>/dev/null || _sc_fifo=""
  done
  if [[ -z $_sc_fifo ]]; then
    "$_sc_ptc_cat" >&2 <<<"sandcell: no place for a tool call's reply in $SC_PTC_DIR"
  else
    "$_sc_ptc_cat" > "$_sc_fifo.in" <<<"$1"$'\n'"${2-}"
    "$_sc_ptc_cat" >&"$SC_PTC_FD" <<<"$_sc_fifo"
    _sc_status=$(<"$_sc_fifo")
    if [[ $_sc_status == ok ]]; then
      "$_sc_ptc_cat" -- "$_sc_fifo.out"
    else
      "$_sc_ptc_cat" -- "$_sc_fifo.out" >&2
    fi
    "$_sc_ptc_rm" -f -- "$_sc_fifo" "$_sc_fifo.in" "$_sc_fifo.out"
  fi
  [[ $_sc_status == ok ]]
}
"""

# Runs inside the context's interpreter after RUNTIME (which it reuses for the answer
# and the decoding of results); the same rounds as _SandcellProgrammatic.
BASH_RUNTIME = (
    r"""
import os as _sc_os, subprocess as _sc_subprocess, tempfile as _sc_tempfile

_SC_BASH_PRELUDE = """
    + repr(_BASH_PRELUDE)
    + r"""

class _SandcellBashProgrammatic:
    def __init__(self, code, tools):
        self.lock = _sc_threading.Lock()
        self.pending = {}
        self.new = []
        self.ids = _sc_it.count(1)
        self.last_call = 0.0
        self.out = []
        self.err = []
        self.dir = _sc_tempfile.mkdtemp(prefix="sandcell-ptc-")
        self.tools = dict(tools)
        # By its bash name (an identifier: no quoting, no newline in the request).
        functions = "".join('%s() { sc-ptc-call %s "$@"; }\n' % (name, name) for name in tools)
        # A file, not ``bash -c``: one argument holds at most 128 KiB (MAX_ARG_STRLEN),
        # so a longer script, or a few thousand tools, was "Argument list too long".
        script = _sc_os.path.join(self.dir, "script.sh")
        with open(script, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(_SC_BASH_PRELUDE + functions + code)
        read_end, write_end = _sc_os.pipe()
        env = dict(_sc_os.environ, SC_PTC_DIR=self.dir, SC_PTC_FD=str(write_end))
        self.process = _sc_subprocess.Popen(
            ["bash", script],
            stdin=_sc_subprocess.DEVNULL,
            stdout=_sc_subprocess.PIPE,
            stderr=_sc_subprocess.PIPE,
            pass_fds=(write_end,),
            env=env,
        )
        _sc_os.close(write_end)
        self.pumps = [
            _sc_threading.Thread(target=self._pump, args=(stream, into), daemon=True)
            for stream, into in ((self.process.stdout, self.out), (self.process.stderr, self.err))
        ]
        for pump in self.pumps:
            pump.start()
        _sc_threading.Thread(target=self._requests, args=(read_end,), daemon=True).start()

    def _pump(self, stream, into):
        for chunk in iter(lambda: stream.read1(65536), b""):
            with self.lock:
                into.append(chunk)

    def _requests(self, read_end):
        with open(read_end, "r", encoding="utf-8", errors="surrogateescape") as requests:
            for line in requests:
                fifo = line.rstrip("\n")
                try:
                    with open(fifo + ".in", "r", encoding="utf-8", errors="replace") as f:
                        request = f.read()
                except OSError:
                    continue
                # The here-string's own newline ends it.
                bash, _, argument = request.removesuffix("\n").partition("\n")
                name = self.tools.get(bash)
                if name is None:
                    self._reply(fifo, "error", "no tool is named %r\n" % bash[:80])
                    continue
                value = _sandcell_decode(argument) if argument.strip() else {}
                with self.lock:
                    call_id = "call_%d" % next(self.ids)
                    self.pending[call_id] = fifo
                    self.new.append({"id": call_id, "name": name, "input": value})
                    self.last_call = _sc_time.monotonic()

    def _reply(self, fifo, status, text):
        def write():
            try:
                with open(fifo + ".out", "w", encoding="utf-8", errors="replace") as f:
                    f.write(text)
                # Opening the FIFO waits for the call's read of it: the result is whole.
                with open(fifo, "w", encoding="utf-8") as f:
                    f.write(status)
            except OSError:
                pass
        _sc_threading.Thread(target=write, daemon=True).start()

    def resume(self, results):
        for item in results:
            with self.lock:
                fifo = self.pending.pop(item.get("call_id"), None)
            if fifo is None:
                continue
            if item.get("is_error"):
                message = item.get("error_message") or "the tool failed"
                self._reply(fifo, "error", message.rstrip("\n") + "\n")
                continue
            value = item.get("result")
            if not isinstance(value, str):
                value = _sc_json.dumps(value, separators=(",", ":"), default=str)
            self._reply(fifo, "ok", value if value == "" or value.endswith("\n") else value + "\n")

    def _flush(self):
        with self.lock:
            # In place: the pumps hold these very lists.
            out, err = self.out[:], self.err[:]
            del self.out[:], self.err[:]
        if out:
            _sc_sys.stdout.write(b"".join(out).decode("utf-8", "replace"))
        if err:
            _sc_sys.stderr.write(b"".join(err).decode("utf-8", "replace"))

    def wait(self, quiet_s):
        while True:
            code = self.process.poll()
            if code is not None:
                # A background job that outlived the script may hold its pipes open.
                for pump in self.pumps:
                    pump.join(2.0)
                self._flush()
                if code == 0:
                    return _SandcellAnswer({"state": "done"})
                shown = code if -9999 <= code <= 9999 else "unknown"
                error = "Sandbox exited with code %s" % shown
                return _SandcellAnswer({"state": "error", "error": error})
            with self.lock:
                ready = self.new and _sc_time.monotonic() - self.last_call >= quiet_s
                if ready:
                    calls, self.new = self.new, []
            if ready:
                self._flush()
                return _SandcellAnswer({"state": "calls", "calls": calls})
            _sc_time.sleep(0.01)
"""
)

_BASH_RESERVED = frozenset(
    {
        *("if", "then", "else", "elif", "fi", "case", "esac", "for", "while", "until"),
        *("do", "done", "in", "function", "select", "time", "coproc", "declare"),
        *("typeset", "local", "readonly", "export", "unset"),
    }
)
"""The words the client's ``normalizeToBashIdentifier`` suffixes (a parity test compares)."""


def bash_name(name: str) -> str:
    """A tool's name as bash code calls it, as ``@librechat/agents`` normalizes it
    (``normalizeToBashIdentifier``): hyphens, spaces and dots to ``_``, other characters
    dropped, a leading digit prefixed with ``_``, a reserved word suffixed with ``_tool``."""
    normalized = re.sub(r"[^a-zA-Z0-9_]", "", re.sub(r"[-\s.]", "_", name))
    if re.match(r"[0-9]", normalized):
        normalized = "_" + normalized
    if normalized in _BASH_RESERVED:
        normalized += "_tool"
    return normalized


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
