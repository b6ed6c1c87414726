"""IPython's cell syntax (``!cmd``, ``%magic``, ``%%magic``) through IPython itself.

E2B's code interpreter is a Jupyter kernel, so the cells clients send are written
for IPython. A cell that is plain Python never gets here (the kernel parses it
first), so the common cell pays nothing and IPython is imported only for the first
cell that needs it (~0.2 s). IPython comes from the host's ``/usr`` (Debian's
``python3-ipython``), like numpy; without it such a cell is the SyntaxError it
always was. IPython is imported by name at run time: the runner's own
environment (and its type checker) has no IPython.

The shell is a real ``InteractiveShell`` over the context's own namespace, so
``get_ipython()`` and every built-in magic behave as in a kernel. What differs,
and why:

- ``!cmd`` runs through ``subprocess`` with the cell's own fds 1 and 2 (which the
  driver forwards as streams), not IPython's default pexpect terminal (the jail has
  no pty for it), and an interrupt interrupts the cell as any other one does.
- What IPython displays (``IPython.display.display``, the inline backend's
  figures) is a result of the cell, as the driver's own ``display`` is.
- A traceback IPython would print (a magic caught the cell's exception) is the
  cell's error instead, as a kernel's client sees it.
- History, the profile and its database live in a temporary directory (the
  jail's /tmp), never in the checkpointed workspace.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from .display import MIMES, b64

__all__ = ["Shell"]

_BINARY = ("image/png", "image/jpeg")


class Shell:
    """The context's IPython shell, made on the first cell that needs it."""

    def __init__(self, namespace: dict[str, Any], result: Callable[[dict[str, Any]], None]):
        self._namespace = namespace
        self._result = result
        self._shell: Any = None
        self._missing = False
        self.hidden: tuple[str, ...] = ()
        """IPython's own files, whose frames a cell's traceback leaves out."""

    def transform(self, code: str) -> str | None:
        """``code`` as the Python IPython runs for it; None without IPython."""
        shell = self._get()
        if shell is None:
            return None
        transformed: str = shell.transform_cell(code)
        return transformed

    def _get(self) -> Any:
        if self._shell is None and not self._missing:
            try:
                self._shell = self._make()
            except ImportError:
                self._missing = True
        return self._shell

    def _make(self) -> Any:
        import tempfile  # here: a context that never needs IPython never loads it

        interactiveshell = importlib.import_module("IPython.core.interactiveshell")
        displaypub = importlib.import_module("IPython.core.displaypub")
        config = importlib.import_module("traitlets.config").Config()
        config.HistoryManager.enabled = False
        config.InteractiveShell.colors = "NoColor"
        config.Completer.use_jedi = False
        base = interactiveshell.InteractiveShell
        # A kernel's shell picks its GUI event loop here; the jail has none, and the
        # inline backend (``%matplotlib inline``) needs no loop at all.
        shell_type: Any = type("SandcellShell", (base,), {"enable_gui": _no_gui})
        publisher_type = type(
            "SandcellPublisher",
            (displaypub.DisplayPublisher,),
            {"publish": lambda _publisher, *args, **kwargs: self._publish(*args, **kwargs)},
        )
        main = sys.modules["__main__"]
        # IPython seeds the namespace (In, Out, exit, get_ipython, ...); a name the
        # context already defined keeps its value.
        kept = dict(self._namespace)
        shell = shell_type.instance(
            config=config,
            ipython_dir=tempfile.mkdtemp(prefix="sandcell-ipython-"),
            user_module=main,
            user_ns=self._namespace,
        )
        self._namespace.update(kept)
        shell.display_pub = publisher_type(shell=shell, parent=shell)
        shell.system = self._system
        shell.showtraceback = _raise_current
        package = os.path.dirname(os.path.dirname(os.path.abspath(str(interactiveshell.__file__))))
        self.hidden = (package + os.sep, "<decorator-gen-")
        return shell

    def _system(self, cmd: str) -> None:
        """``!cmd``: the shell command as a child of the cell, its output the cell's."""
        import subprocess  # here, as tempfile

        command = self._shell.var_expand(cmd, depth=1)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        code = subprocess.call(command, shell=True, executable=os.environ.get("SHELL"))  # noqa: S602 - the cell's own command
        # IPython's convention: a signal's number, negated.
        self._namespace["_exit_code"] = -(code - 128) if code > 128 else code

    def _publish(
        self,
        data: dict[str, Any],
        metadata: Any = None,
        source: Any = None,
        *,
        transient: Any = None,
        update: bool = False,
        **_: Any,
    ) -> None:
        bundle: dict[str, Any] = {}
        for mime, item in data.items():
            if mime not in MIMES:
                continue
            if isinstance(item, bytes | bytearray) and mime in _BINARY:
                bundle[mime] = b64(item)
            elif isinstance(item, bytes | bytearray):
                bundle[mime] = item.decode("utf-8", "replace")
            else:
                bundle[mime] = item
        self._result(bundle)


def _raise_current(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> None:
    """A magic that caught the cell's exception (``%time 1/0``) fails the cell with it.

    A kernel would send the traceback as the cell's error; the driver's way to do
    that is to let the exception end the cell.
    """
    error = exc_tuple[1] if exc_tuple is not None else sys.exc_info()[1]
    if isinstance(error, BaseException):
        raise error
    raise RuntimeError("IPython reported an error it did not name")


def _no_gui(self: Any, gui: str | None = None) -> None:
    return None
