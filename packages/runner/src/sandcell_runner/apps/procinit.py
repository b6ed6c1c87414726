"""The init every background process runs under: PID 1 of its jail, like ``docker --init``.

A jailed process is PID 1 of its own pid namespace, and the kernel drops signals
PID 1 has no handler for: ``python -m http.server`` or ``node server.js`` as PID 1
would ignore the SIGTERM of a stop and only a SIGKILL would end them. It would
also inherit every orphan and never reap it. This init (run by the jail's own
``python3``) forwards TERM, INT, HUP, QUIT, USR1 and USR2 to the command's process
group, reaps every child, and exits when the command does, which ends the pid
namespace and every process left in it.

PID 1 cannot die of a signal it does not handle, so a command killed by SIGTERM
would look like ``exit 143``: the init writes ``exit N`` or ``signal N`` to the
descriptor named by its first argument (passed through nsjail), and the runner
reports that instead of guessing from 128+N (``session_process.read_report``).

Arguments: ``<report fd> <working directory> <argv…>``.
"""

from __future__ import annotations

# The report is read by the one reader both inits share.
from ..session_process import parse_report

INIT_SOURCE = """\
import os, signal, sys
report, cwd, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
try:
    os.set_inheritable(report, False)
except OSError:
    report = -1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)
child = 0
def forward(signum, frame):
    if child:
        try:
            os.killpg(child, signum)
        except OSError:
            try:
                os.kill(child, signum)
            except OSError:
                pass
for s in FORWARDED:
    signal.signal(s, forward)
child = os.fork()
if child == 0:
    try:
        os.setpgid(0, 0)
        for s in FORWARDED + (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(s, signal.SIG_DFL)
        os.chdir(cwd)
        os.execvp(argv[0], argv)
    except BaseException as exc:
        os.write(2, ("sandcell: cannot start %s: %s\\n" % (argv[0], exc)).encode())
    os._exit(127)
try:
    os.setpgid(child, child)
except OSError:
    pass
status = 0
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == child:
        break
if os.WIFSIGNALED(status):
    line, code = "signal %d\\n" % os.WTERMSIG(status), 128 + os.WTERMSIG(status)
else:
    line, code = "exit %d\\n" % os.WEXITSTATUS(status), os.WEXITSTATUS(status)
if report >= 0:
    try:
        os.write(report, line.encode())
    except OSError:
        pass
os._exit(code)
"""


__all__ = ["INIT_SOURCE", "parse_report"]
