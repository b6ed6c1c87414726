"""Whether nsjail can run as a job's own unprivileged UID on this host (at start-up)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["probe_job_user_nsjail"]


def probe_job_user_nsjail(nsjail: Path, uid: int) -> str | None:
    """Whether nsjail can run as an unprivileged ``uid`` here: None if so, else why not.

    It cannot when job UIDs may not execute the binary (it lies under a 0700
    home), or when unprivileged user namespaces are off (a sysctl, or a container
    engine's seccomp profile that allows them only with CAP_SYS_ADMIN). Run once
    at start-up, before the event loop, so plain ``subprocess`` switches the UID.
    """
    argv = [str(nsjail), "-Mo", "--quiet", "--disable_proc", "-u", str(uid), "-g", str(uid)]
    argv += ["--chroot", "/", "--", "/bin/true"]
    try:
        probe = subprocess.run(
            argv,
            capture_output=True,
            timeout=10,
            check=False,
            env={},
            user=uid,
            group=uid,
            extra_groups=[],
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"probe failed: {exc}"
    if probe.returncode != 0:
        tail = probe.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        return f"nsjail as uid {uid} exited {probe.returncode}: {tail[0][:200]}"
    return None
