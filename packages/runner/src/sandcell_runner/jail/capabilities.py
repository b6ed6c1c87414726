"""Which capabilities this process holds, read from ``/proc/self/status``.

Root alone says little: a container's root holds only what its engine granted
(no ``CAP_SYS_NICE`` or ``CAP_NET_ADMIN`` unless asked for), so a feature that
needs one checks the bit rather than the UID.
"""

from __future__ import annotations

from pathlib import Path

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CAP_SYS_NICE = 23


def effective_capabilities(status: Path = Path("/proc/self/status")) -> int:
    """This process's effective capability set (``CapEff``), as a bit mask."""
    for line in status.read_text(encoding="ascii", errors="replace").splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def holds(capability: int, status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process may use ``capability`` (one of the ``CAP_*`` numbers)."""
    return bool(effective_capabilities(status) & (1 << capability))


__all__ = ["CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_SYS_NICE", "effective_capabilities", "holds"]
