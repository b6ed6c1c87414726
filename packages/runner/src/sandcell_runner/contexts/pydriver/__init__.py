"""The Python context driver: a notebook-like interpreter loop, run inside the jail.

This package is copied into the context's job directory (as ``sandcell_pydriver``,
beside the launcher ``drivers.py`` writes) and run by the jail's own ``python3 -I``
(standard library only: the jail has no runner packages). It is PID 1 of the
jail's pid namespace. Its modules: ``channel`` (the frames over the runner's
pipes, and the cell's output as frames), ``display`` (a value's representations),
``kernel`` (a context's namespace and its runs), ``ipython`` (IPython's cell
syntax, through the host's IPython when a cell needs it), ``main`` (the loop).

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
