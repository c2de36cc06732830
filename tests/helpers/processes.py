"""Processes a test started, and what they started: for the tests that kill a parent and
check that its children end with it."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> set[int]:
    """The direct children of ``pid`` (every thread's)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.update(int(c) for c in (task / "children").read_text().split())
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def kill_and_list_survivors(parent, pids, seconds: float = 10.0) -> list[int]:
    """SIGKILL the ``subprocess.Popen`` ``parent``, give ``pids`` (what it started) ``seconds``
    to end with it, and return those still running, after killing them too: a test never
    leaves its own processes behind."""
    import os
    import signal
    import time

    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left
