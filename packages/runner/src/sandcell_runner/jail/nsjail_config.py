"""One job's nsjail configuration: namespaces, rlimits, mounts and the seccomp policy.

Renders a ``JobSpec`` to nsjail's protobuf text format, nothing more; ``nsjail.py``
passes the text to nsjail through a memfd and runs the job.
"""

from __future__ import annotations

import math

from ..config import MIB
from ..languages import JOB_DIR, WORKSPACE_DIR
from .spec import JobSpec

# Syscalls a job never needs and that widen the kernel's attack surface. clone()
# with any CLONE_NEW* flag gets its own rule: blocking unshare() alone does not stop
# a nested user namespace. clone3 answers ENOSYS so libc falls back to clone(),
# whose flags seccomp can inspect, and threads keep working.
#
# Kernel-wide budgets (docs: "Kernel budgets"): fanotify groups and marks are
# refused (no language runtime we ship needs them; inotify serves file watchers);
# io_setup answers ENOSYS, as on a kernel without native AIO, because its
# contexts count against fs.aio-max-nr, one counter for the whole host (glibc's
# POSIX AIO and libuv use threads, not io_setup).
SECCOMP_POLICY = (
    "ERRNO(1) { ptrace, process_vm_readv, process_vm_writev, mount, umount, "
    "pivot_root, chroot, unshare, setns, keyctl, add_key, request_key, bpf, userfaultfd, "
    "perf_event_open, kexec_load, kexec_file_load, init_module, finit_module, delete_module, "
    "reboot, swapon, swapoff, syslog, acct, open_by_handle_at, name_to_handle_at, fsopen, "
    "fsmount, fsconfig, fspick, move_mount, open_tree, io_uring_setup, io_uring_enter, "
    "io_uring_register, fanotify_init, fanotify_mark }",
    "ERRNO(1) { clone { (clone_flags & 0x7E020000) != 0 } }",
    "ERRNO(38) { clone3, io_setup }",
    "DEFAULT ALLOW",
)

# The most a job's configuration may take; ``nsjail.py`` refuses a larger one. Why no
# request within the protocol's caps reaches it (tests/runner/test_bad_input.py runs
# the worst case, ``test_as_many_variables_as_the_env_rule_admits_run``):
# - A request's only lines are its variables, one ``envar: "NAME=value"`` each: the
#   escaped entry, which ``env_bytes`` counts and ``validate_env`` caps at
#   MAX_ENV_BYTES (49,152), plus 10 bytes of line. The most variables that admits is
#   13,149 (distinct names as short as names go, empty values), so the variables take
#   at most 49,152 + 10 x 13,149 = 180,642 bytes.
# - Inputs, however many, add nothing: priming copies them into the workspace; none is
#   bind-mounted. The read-only binds are the runner's own (ruff for analysis, the
#   egress resolv.conf, one each), the other paths are its settings' (workspace root,
#   job directory), and the rest is fixed text: ~4.5 KB in all, its own variables
#   included.
# 256 KiB leaves ~80 KB for long configured paths. It was 60,000 bytes, from when the
# configuration went through a pipe: 5,000 empty variables (30,000 bytes by
# ``env_bytes``) made 83 KB of configuration, a 500 at every run. nsjail itself read a
# 500 KB configuration of 20,000 variables (2026-12-07).
MAX_CONFIG_BYTES = 256 << 10

_SYSTEM_MOUNTS = (
    # (source, mandatory)
    ("/usr", True),
    ("/lib", True),
    ("/lib64", False),
    ("/bin", True),
    ("/sbin", False),
    ("/etc/ld.so.cache", False),
    ("/etc/alternatives", False),
    ("/etc/localtime", False),
    # Debian's matplotlib reads its defaults from here (without it, import fails),
    # and fontconfig its configuration.
    ("/etc/matplotlibrc", False),
    ("/etc/fonts", False),
)
_NETWORK_MOUNTS = ("/etc/resolv.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates")


def render_config(spec: JobSpec, *, cgroups_available: bool) -> str:
    """The nsjail configuration of one job (protobuf text format).

    ``cgroups_available``: memory and pids are limited by the job cgroup, not rlimits.
    """
    limits = spec.limits
    timeout_s = max(1, math.ceil(limits.timeout_ms / 1000))
    lines = [
        'name: "sandcell-job"',
        "mode: ONCE",
        'hostname: "sandbox"',
        f'cwd: "{WORKSPACE_DIR}"',
        # Backstop only: the runner's own timer kills at the exact deadline.
        f"time_limit: {0 if spec.long_running else timeout_s + 2}",
        # INFO: the last line says "exited with status: N" or "terminated with
        # signal: SIGX (N)", the only way to tell `exit 137` from a SIGKILL.
        "log_level: INFO",
        "keep_env: false",
        "keep_caps: false",
        "disable_no_new_privs: false",
        f"clone_newnet: {'false' if spec.network or spec.netns_fd is not None else 'true'}",
        "clone_newuser: true",
        "clone_newns: true",
        "clone_newpid: true",
        "clone_newipc: true",
        "clone_newuts: true",
        "clone_newcgroup: true",
        f'uidmap {{ inside_id: "{spec.uid}" outside_id: "{spec.uid}" count: 1 }}',
        f'gidmap {{ inside_id: "{spec.gid}" outside_id: "{spec.gid}" count: 1 }}',
        "rlimit_cpu_type: INF" if spec.long_running else f"rlimit_cpu: {timeout_s + 1}",
        f"rlimit_fsize: {limits.file_size_mib}",
        f"rlimit_nofile: {limits.open_files}",
        "rlimit_core: 0",
        "rlimit_stack: 8",
    ]
    if cgroups_available:
        lines.append("rlimit_as_type: INF")
    else:
        # Without a memory cgroup, address space is the only memory bound left.
        lines.append(f"rlimit_as: {max(64, limits.memory_bytes // MIB)}")
        lines.append(f"rlimit_nproc: {limits.pids}")
    if spec.long_running:
        lines.append("forward_signals: true")
    lines += [f"pass_fd: {fd}" for fd in spec.pass_fds]
    for key, value in spec.env.items():
        lines.append(f"envar: {_quote(f'{key}={value}')}")
    lines.append("mount_proc: true")
    lines += _SYSTEM_BINDS
    if spec.network:
        lines += _NETWORK_BINDS
    elif spec.netns_fd is not None:
        # Without it "localhost" does not resolve, and dev servers bind to it.
        lines.append(_HOSTS_BIND)
    lines += _DEV_MOUNTS
    lines += [
        f'mount {{ dst: "/tmp" fstype: "tmpfs" options: "size={limits.tmp_mib * MIB}" '
        "rw: true nosuid: true nodev: true }",
        _bind(str(spec.job_dir), JOB_DIR, rw=False),
        _bind(str(spec.workspace), WORKSPACE_DIR, rw=True),
    ]
    for bind_source, target in spec.readonly_binds:
        lines.append(_bind(str(bind_source), target, rw=False))
    if spec.home_link is not None:
        lines.append(
            f"mount {{ src: {_quote(WORKSPACE_DIR)} dst: {_quote(spec.home_link)} "
            "is_symlink: true }"
        )
    if spec.devpts:
        # A fresh instance: the job sees only its own terminals, never the host's.
        lines.append(
            'mount { dst: "/dev/pts" fstype: "devpts" '
            'options: "newinstance,ptmxmode=0666,mode=0620" rw: true nosuid: true noexec: true }'
        )
        lines.append('mount { src: "/dev/pts/ptmx" dst: "/dev/ptmx" is_symlink: true }')
    lines += _SECCOMP_LINES
    return "\n".join(lines) + "\n"


def _bind(source: str, target: str, *, rw: bool, mandatory: bool = True) -> str:
    flags = f"rw: {'true' if rw else 'false'} nosuid: true nodev: true"
    optional = "" if mandatory else " mandatory: false"
    return (
        f"mount {{ src: {_quote(source)} dst: {_quote(target)} is_bind: true {flags}{optional} }}"
    )


def _quote(value: str) -> str:
    """A protobuf text-format string literal (escapes everything but printable ASCII)."""
    # Fast path: most values (paths, seccomp rules) need no escaping; the per-byte
    # loop below cost ~0.7 ms of CPU per job when run on every line.
    if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
        return f'"{value}"'
    out = ['"']
    for byte in value.encode("utf-8"):
        char = chr(byte)
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    out.append('"')
    return "".join(out)


# The lines every job's configuration shares, rendered once: quoting them for each
# job was two thirds of ``render_config`` (32 ``_quote`` calls a job, 9 now).
_SYSTEM_BINDS = tuple(
    _bind(source, source, rw=False, mandatory=mandatory) for source, mandatory in _SYSTEM_MOUNTS
)
_NETWORK_BINDS = tuple(
    _bind(source, source, rw=False, mandatory=False) for source in _NETWORK_MOUNTS
)
_HOSTS_BIND = _bind("/etc/hosts", "/etc/hosts", rw=False, mandatory=False)
_DEV_MOUNTS = (
    'mount { dst: "/dev" fstype: "tmpfs" options: "size=1048576,mode=755" rw: true '
    "nosuid: true noexec: true }",
    'mount { src: "/dev/null" dst: "/dev/null" is_bind: true rw: true }',
    'mount { src: "/dev/zero" dst: "/dev/zero" is_bind: true rw: true }',
    'mount { src: "/dev/full" dst: "/dev/full" is_bind: true rw: true mandatory: false }',
    'mount { src: "/dev/urandom" dst: "/dev/urandom" is_bind: true rw: false }',
    'mount { src: "/dev/urandom" dst: "/dev/random" is_bind: true rw: false }',
    f'mount {{ dst: "/dev/shm" fstype: "tmpfs" options: "size={16 * MIB}" rw: true '
    "nosuid: true nodev: true }",
    'mount { src: "/proc/self/fd" dst: "/dev/fd" is_symlink: true }',
    'mount { src: "/proc/self/fd/0" dst: "/dev/stdin" is_symlink: true }',
    'mount { src: "/proc/self/fd/1" dst: "/dev/stdout" is_symlink: true }',
    'mount { src: "/proc/self/fd/2" dst: "/dev/stderr" is_symlink: true }',
)
_SECCOMP_LINES = tuple(f"seccomp_string: {_quote(rule)}" for rule in SECCOMP_POLICY)

__all__ = ["MAX_CONFIG_BYTES", "MIB", "SECCOMP_POLICY", "render_config"]
