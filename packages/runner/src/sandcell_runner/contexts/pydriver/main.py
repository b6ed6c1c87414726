"""The driver's loop: set up the pipes and streams, then run what the runner sends."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import warnings

from .channel import Channel, FdForwarder, FrameStream, Interrupts
from .kernel import Kernel

__all__ = ["main", "reap"]


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


def main(launcher: str) -> None:
    """The driver, started by ``launcher`` (the script the jail runs)."""
    cwd = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    # The launcher's frame and this package's: left out of every cell's traceback.
    hidden = (os.path.abspath(launcher), os.path.dirname(os.path.abspath(__file__)) + os.sep)
    interrupts = Interrupts()
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
    kernel = Kernel(channel, forwarder, interrupts, hidden=hidden)
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
