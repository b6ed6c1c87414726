"""The init an interactive sandbox process runs under: PID 1 of its jail.

Like ``apps/procinit.py`` (why a jailed process needs an init: signals to PID 1,
orphans, an exact exit report), plus what an interactive process needs:

- stderr apart from stdout: the runner passes a second pipe (``stderr fd``) that
  the command gets as its fd 2;
- a control pipe (``control fd``) the runner writes one-line commands to:
  ``s N`` sends signal N to the command's process group, ``r COLS ROWS`` resizes
  its terminal;
- with ``pty`` a pseudo-terminal opened here, inside the jail (the jail mounts a
  devpts instance of its own): the command runs as a session leader on its slave
  side; the init relays its stdin (fd 0) to the master and the master to fd 1.

Arguments: ``<report fd> <stderr fd> <control fd> <cwd> <pipe|COLSxROWS> <argv…>``.
The init writes ``exit N`` or ``signal N`` to the report descriptor when the
command ends, and exits (ending the pid namespace).
"""

from __future__ import annotations

INIT_SOURCE = r"""
import errno, fcntl, os, select, signal, struct, sys, termios
report, err_fd, control = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cwd, mode, argv = sys.argv[4], sys.argv[5], sys.argv[6:]
for fd in (report, err_fd, control):
    os.set_inheritable(fd, False)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)
child = 0
def send(signum):
    if child:
        try:
            os.killpg(child, signum)
        except OSError:
            try:
                os.kill(child, signum)
            except OSError:
                pass
for s in FORWARDED:
    signal.signal(s, lambda signum, _frame: send(signum))
master = -1
def winsize(cols, rows):
    return struct.pack("HHHH", rows, cols, 0, 0)
if mode != "pipe":
    cols, rows = (int(v) for v in mode.split("x"))
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, winsize(cols, rows))
child = os.fork()
if child == 0:
    try:
        for s in FORWARDED + (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        if master >= 0:
            os.setsid()
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
            for fd in (0, 1, 2):
                os.dup2(slave, fd)
            os.close(slave)
            os.close(master)
        else:
            os.setpgid(0, 0)
            os.dup2(err_fd, 2)
        os.chdir(cwd)
        os.execvp(argv[0], argv)
    except BaseException as exc:
        os.write(2, ("sandcell: cannot start %s: %s\n" % (argv[0], exc)).encode())
    os._exit(127)
os.close(err_fd)
if master >= 0:
    os.close(slave)
    os.set_blocking(master, False)
else:
    try:
        os.setpgid(child, child)
    except OSError:
        pass
    os.close(0)
readers = [wake_r, control] + ([master, 0] if master >= 0 else [])
pending = b""
status = None
def drain_master():
    while True:
        try:
            data = os.read(master, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        os.write(1, data)
while status is None:
    try:
        ready, _, _ = select.select(readers, [], [], 1.0)
    except InterruptedError:
        ready = []
    for fd in ready:
        if fd == wake_r:
            os.read(wake_r, 512)
        elif fd == control:
            data = os.read(control, 4096)
            if not data:
                readers.remove(control)
                continue
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                parts = line.split()
                if parts[:1] == [b"s"] and len(parts) == 2:
                    send(int(parts[1]))
                elif parts[:1] == [b"r"] and len(parts) == 3 and master >= 0:
                    fcntl.ioctl(master, termios.TIOCSWINSZ,
                                winsize(int(parts[1]), int(parts[2])))
        elif fd == master:
            if not drain_master():
                readers.remove(master)
        elif fd == 0:
            data = os.read(0, 65536)
            if not data:
                readers.remove(0)
                continue
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(master, view):]
                except BlockingIOError:
                    select.select([], [master], [], 1.0)
                except OSError:
                    break
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid == child:
            status = st
if master >= 0:
    drain_master()
if os.WIFSIGNALED(status):
    line, code = "signal %d\n" % os.WTERMSIG(status), 128 + os.WTERMSIG(status)
else:
    line, code = "exit %d\n" % os.WEXITSTATUS(status), os.WEXITSTATUS(status)
try:
    os.write(report, line.encode())
except OSError:
    pass
os._exit(code)
"""


__all__ = ["INIT_SOURCE"]
