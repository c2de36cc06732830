"""Peak anonymous memory (``RssAnon``) of a process tree, sampled from ``/proc``.

Why ``RssAnon`` and the whole tree: ``VmRSS`` counts the page-cache pages of memory-mapped
checkpoints, which moved 1–2 GB between identical runs; and vLLM (and GPTQModel's worker
pools) do their work in child processes that the parent's own numbers miss
(``shared/MEASURING.md`` rules 1 and 2).

``TreeRssSampler(pid)`` runs a thread that, every ``interval`` seconds, finds every live
descendant of ``pid`` (``/proc/PID/task/TID/children``, or a scan of ``/proc/*/stat`` for
parent ids where the kernel lacks that file) and sums their
``RssAnon`` (``/proc/PID/status``, kB → bytes). ``peak_bytes`` is the largest sum seen;
``samples`` is how many sums were taken. A spike shorter than ``interval`` can be missed:
the interval is recorded with every measurement.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PROC = Path("/proc")
DEFAULT_INTERVAL = 0.1

try:  # one reader of RssAnon for the whole project, when the runtime side provides it
    from cpu_quant.core.memory import anon_rss_bytes as _project_anon_rss
except ImportError:  # pragma: no cover - older trees
    _project_anon_rss = None


def anon_rss_bytes(pid: int) -> int:
    """``RssAnon`` of one process (not its children) in bytes; 0 if it is gone or has no mm."""
    if _project_anon_rss is not None:
        from cpu_quant.core.errors import CpuQuantError

        try:
            # tree=False: this module walks the tree itself; summing per-pid trees double counts
            return _project_anon_rss(pid, tree=False)
        except CpuQuantError:  # it exited between being listed and being read
            return 0
    try:
        with open(PROC / str(pid) / "status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return 0


def _parent_of(pid: int) -> int | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1])


def _children(pid: int) -> list[int] | None:
    """Children of ``pid`` from ``/proc/PID/task/*/children``; None if the kernel lacks it."""
    try:
        tasks = os.listdir(PROC / str(pid) / "task")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    out: list[int] = []
    for tid in tasks:
        try:
            text = (PROC / str(pid) / "task" / tid / "children").read_text()
            out.extend(int(c) for c in text.split())
        except FileNotFoundError:
            if not (PROC / str(pid) / "task" / tid).exists():
                continue  # the thread ended meanwhile
            return None  # CONFIG_PROC_CHILDREN is off: scan /proc instead
        except (ProcessLookupError, PermissionError):
            continue
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = _children(pid)
        if kids is None:
            return _process_tree_by_scan(root)
        tree.append(pid)
        todo.extend(kids)
    return tree


def _process_tree_by_scan(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir(PROC):
        if entry.isdigit():
            ppid = _parent_of(int(entry))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def tree_anon_rss_bytes(root: int) -> int:
    return sum(anon_rss_bytes(pid) for pid in process_tree(root))


class TreeRssSampler:
    """Samples the summed ``RssAnon`` of ``pid``'s process tree until stopped."""

    def __init__(self, pid: int, interval: float = DEFAULT_INTERVAL) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_bytes = 0
        self.peak_processes = 0
        self.peak_at_seconds = 0.0  # when the peak was seen, from start(): locates a transient
        self._started = time.monotonic()
        self.samples = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rss-{pid}", daemon=True)

    def _sample(self) -> None:
        pids = process_tree(self.pid)
        total = sum(anon_rss_bytes(p) for p in pids)
        self.samples += 1
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_processes = len(pids)
            self.peak_at_seconds = time.monotonic() - self._started

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as exc:  # never stop sampling silently: count and keep going
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.interval)

    def start(self) -> TreeRssSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes

    def as_dict(self) -> dict:
        return {"peak_rss_anon_bytes": self.peak_bytes, "peak_processes": self.peak_processes,
                "peak_at_seconds": round(self.peak_at_seconds, 2),
                "samples": self.samples, "interval_s": self.interval,
                "sample_errors": len(self.errors), "first_error": self.errors[0] if self.errors
                else None}
