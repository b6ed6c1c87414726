"""The restore extractor's jail: what a job gets from nsjail, applied by the child itself.

A tarfile or zstd parser bug is exactly the extractor's threat model, so it is
confined like a job: its own cgroup under the runner's instance (memory, pids,
and the session's CPU quota), an empty network namespace and its own IPC
namespace, rlimits (no core dumps, bounded file size and open files), a chroot
into the staging directory, the pinned UID, ``no_new_privs``, and a seccomp filter
refusing everything a job's policy refuses (``jail/nsjail_config.py``) plus what
an extractor never does: exec, fork (threads stay allowed: the decompressor runs
one) and sockets.

Why not nsjail itself: the extractor is Python, and a jail would have to mount
the interpreter, the virtualenv and every editable source tree, which may live
where job UIDs cannot reach (``/root/.pyenv``); the child already starts as root,
so it makes the same kernel calls nsjail would, in the same order, before it
reads a byte. The filter is built here from x86_64 syscall numbers, because the
Python standard library has no seccomp binding; on another architecture the
extractor keeps the rest of its jail but has no filter (``supported``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNET = 0x40000000
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_RET_KILL = 0x80000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_NEW_FLAGS = 0x7E020000  # every CLONE_NEW* flag, as in the job's policy

# x86_64 numbers. The job's ERRNO(1) list, then what an extractor never needs.
_REFUSED = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165,
    "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
    "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "userfaultfd": 323,
    "perf_event_open": 298, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168,
    "syslog": 103, "acct": 163, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "fsopen": 430, "fsmount": 432, "fsconfig": 431, "fspick": 433, "move_mount": 429,
    "open_tree": 428, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "fanotify_init": 300, "fanotify_mark": 301,
    "execve": 59, "execveat": 322, "fork": 57, "vfork": 58, "socket": 41, "socketpair": 53,
}  # fmt: skip
_NOT_IMPLEMENTED = {"clone3": 435, "io_setup": 206}
# The fork server's own filter: the same, less what each child still does before
# its own (unshare its namespaces, chroot). The server forks with glibc's fork,
# which is clone without CLONE_NEW* flags: allowed by both filters.
_SERVER_REFUSED = {k: v for k, v in _REFUSED.items() if k not in ("unshare", "chroot")}
_PR_SET_PDEATHSIG = 1
_CLONE = 56

_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_Insn = tuple[int, int, int, int]


def _program(refused: dict[str, int]) -> list[_Insn]:
    ret_eperm = (_RET_K, 0, 0, _RET_ERRNO | _EPERM)
    prog: list[_Insn] = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        (_RET_K, 0, 0, _RET_KILL),  # i386 (int 0x80) and anything else
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JGE_K, 0, 1, _X32_BIT),
        ret_eperm,  # the x32 ABI
    ]
    for number in sorted(refused.values()):
        prog += [(_JEQ_K, 0, 1, number), ret_eperm]
    for number in sorted(_NOT_IMPLEMENTED.values()):
        prog += [(_JEQ_K, 0, 1, number), (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS)]
    prog += [
        (_JEQ_K, 0, 3, _CLONE),
        (_LD_W_ABS, 0, 0, 16),  # args[0], low half: the clone flags
        (_JSET_K, 0, 1, _CLONE_NEW_FLAGS),
        ret_eperm,
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    return prog


def supported() -> bool:
    """Whether this machine's architecture has a filter here."""
    return platform.machine() == "x86_64"


def isolate_namespaces() -> None:
    """An empty network namespace and a private IPC namespace (as root, before the chroot)."""
    if _libc.unshare(_CLONE_NEWNET | _CLONE_NEWIPC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"extractor: unshare: {os.strerror(err)}")


def limit_resources(*, max_file_bytes: int | None) -> None:
    """A job's rlimits: no core dumps, files no larger than the archive may hold (if given)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if max_file_bytes is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))


def die_with_parent(parent: int) -> None:
    """SIGKILL when ``parent`` dies; exits at once if it already has.

    Set after any credential change (which clears it), before the filter.
    """
    if _libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "extractor: PR_SET_PDEATHSIG")
    if os.getppid() != parent:
        os._exit(126)


def install_seccomp(*, server: bool = False) -> None:
    """``no_new_privs`` and the filter; the calling thread's, inherited by later threads
    and by forked children (which stack their own on it).

    ``server``: the fork server's, which lets its children unshare and chroot.
    """
    if not supported():
        raise OSError("extractor: no seccomp filter for this architecture")
    prog = _program(_SERVER_REFUSED if server else _REFUSED)
    raw = b"".join(struct.pack("=HBBI", *insn) for insn in prog)
    buffer = ctypes.create_string_buffer(raw, len(raw))

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Fprog(len(prog), ctypes.addressof(buffer))
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "extractor: PR_SET_NO_NEW_PRIVS")
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"extractor: seccomp: {os.strerror(err)}")


__all__ = [
    "die_with_parent",
    "install_seccomp",
    "isolate_namespaces",
    "limit_resources",
    "supported",
]
