"""The spawn helper's vfork path (``_vfork.c``); optional, loaded by ``spawnd.py``."""

def spawn(
    argv: list[bytes],
    envp: list[bytes],
    fds: list[int],
    targets: list[int],
    join_paths: list[bytes],
    join_fds: list[int],
    netns_fd: int,
    cwd: bytes | None,
    uid: int,
    gid: int,
    setsid: bool,
    parent: int,
    /,
) -> tuple[int, str, int, int]:
    """vfork, set up as ``spawnd._child`` does, exec ``argv[0]``.

    ``(pid, "", 0, -1)`` once the child exec'd; ``(0, step, errno, index)`` when a step
    failed (the child is reaped; ``index``: the join path at fault, else -1).
    ``netns_fd``, ``uid``, ``gid``: -1 for none. ``fds[:len(targets)]`` land at ``targets``.
    """
