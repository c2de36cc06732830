"""Anonymous resident memory of a process tree, the memory metric every runtime benchmark uses.

Format read: ``/proc/PID/status`` line ``RssAnon:  <n> kB`` (kB = 1024 bytes), the process's
anonymous resident pages. ``VmRSS`` is not used because it also counts page-cache pages of a
memory-mapped checkpoint, which move by gigabytes between identical runs; ``RssAnon`` repeats
to within a fraction of a percent (shared/MEASURING.md, rule 1).

vLLM on CPU keeps the weights in spawned worker processes, so the default sums over the process
and all of its descendants (children found through the parent pid in ``/proc/PID/stat``).
A kernel thread or a process without an mm has no ``RssAnon`` line and counts as 0.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CpuQuantError

_PROC = Path("/proc")


def _read_rss_anon_kib(pid: int) -> int | None:
    """RssAnon of one process in KiB; None when the process is gone."""
    try:
        text = (_PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def _parent_pid(pid: int) -> int | None:
    """Parent pid from /proc/PID/stat; the comm field may contain spaces and ')' so split on
    the last ')'."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[1])


def descendant_pids(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children, grandchildren, ...), in no particular order."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        child = int(entry.name)
        parent = _parent_pid(child)
        if parent is not None:
            children.setdefault(parent, []).append(child)
    found: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        p = stack.pop()
        found.append(p)
        stack.extend(children.get(p, []))
    return found


def anon_rss_bytes(pid: int | None = None, tree: bool = True) -> int:
    """RssAnon in bytes of ``pid`` (default: this process), summed over all descendants when
    ``tree`` is true. Descendants that exit while being read are skipped."""
    pid = os.getpid() if pid is None else pid
    own = _read_rss_anon_kib(pid)
    if own is None:
        raise CpuQuantError(f"no process with pid {pid}: cannot read /proc/{pid}/status")
    total = own
    if tree:
        for child in descendant_pids(pid):
            total += _read_rss_anon_kib(child) or 0
    return total * 1024
