"""Process memory: what the quantizer and the runtime patches both use, with no vLLM import.

* :func:`anon_rss_bytes`: anonymous resident memory of a process tree, the memory metric every
  benchmark uses;
* :func:`allocator_releasers` and :func:`pin_mmap_threshold`: handing free heap back to the
  system, and glibc's mmap threshold.

RssAnon is read from ``/proc/PID/status`` line ``RssAnon:  <n> kB`` (kB = 1024 bytes), the process's
anonymous resident pages. ``VmRSS`` is not used because it also counts page-cache pages of a
memory-mapped checkpoint, which move by gigabytes between identical runs; ``RssAnon`` repeats
to within a fraction of a percent (shared/MEASURING.md, rule 1).

vLLM on CPU keeps the weights in spawned worker processes, so the default sums over the process
and all of its descendants (children found through the parent pid in ``/proc/PID/stat``).
A kernel thread or a process without an mm has no ``RssAnon`` line and counts as 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from pathlib import Path

from .errors import CpuQuantError

_PROC = Path("/proc")


def read_rss_anon_kib(pid: int) -> int | None:
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
    own = read_rss_anon_kib(pid)
    if own is None:
        raise CpuQuantError(f"no process with pid {pid}: cannot read /proc/{pid}/status")
    total = own
    if tree:
        for child in descendant_pids(pid):
            total += read_rss_anon_kib(child) or 0
    return total * 1024


def available_bytes() -> int:
    """The memory the kernel can give new allocations without swapping (``MemAvailable``),
    or, where /proc/meminfo cannot be read, the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def allocator_releasers() -> dict[str, Callable[[], None]]:
    """The free-memory release calls reachable in this process, by allocator name."""
    return dict(_allocator_releasers())


@functools.lru_cache(maxsize=1)
def _allocator_releasers() -> dict[str, Callable[[], None]]:
    # Looked up once per process: ``ctypes.util.find_library`` runs ``ldconfig -p`` in a child
    # process, and the quantizer releases memory after every layer. A fork of a large process
    # also shows, for an instant, as a second copy of its anonymous memory to anything that sums
    # RssAnon over the process tree (measured: one-off "peaks" of 1.16 and 1.29 GB in the memory
    # benchmark where the real peak was 0.8 GB).
    found: dict[str, Callable[[], None]] = {}
    process = ctypes.CDLL(None)
    # tcmalloc (gperftools, full or minimal) exports this C entry point; it is only present
    # when the library is loaded, e.g. through LD_PRELOAD.
    tcmalloc_release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if tcmalloc_release is not None:
        tcmalloc_release.restype = None
        tcmalloc_release.argtypes = []
        found["tcmalloc"] = tcmalloc_release
    # not glibc (e.g. musl): nothing to trim there
    malloc_trim = getattr(libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim.restype = ctypes.c_int
        malloc_trim.argtypes = [ctypes.c_size_t]
        found["glibc"] = functools.partial(malloc_trim, 0)
    return found


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def pin_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc malloc's mmap threshold at ``nbytes`` for the rest of the process.

    By default glibc raises the threshold (up to 32 MiB) each time a memory-mapped block is freed,
    so that repeated large allocations move onto the heap. A long run of identical steps then
    fragments the heap: its size grows while the bytes in use stay constant, and a step's freed
    blocks stay resident until the next ``malloc_trim``. Pinning the threshold turns off that
    adjustment: blocks of ``nbytes`` and more are mapped and unmapped on their own. Returns
    whether it was applied: not where the allocator is not glibc, nor where the user set
    ``MALLOC_MMAP_THRESHOLD_`` (theirs wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))


@functools.lru_cache(maxsize=1)
def libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


# Blocks of this size and more are memory-mapped on their own (glibc), for the whole process.
# glibc's default threshold moves (up to 32 MiB) to the size of each freed mapped block; over a
# long run of identical layers the heap then fragments: measured on synthetic models of the
# demo model's shapes (8 x 512 calibration tokens, docs/reliability.md), its size grew by about
# 4 MB per layer at a constant 171 MB in use, and peak RssAnon followed (640 MiB at 30 layers,
# 797 at 120). A fixed threshold stops that. Its cost is in the blocks it maps afresh: at the
# default 128 x 512 calibration, interleaved 3-pass run (memory-20261201T135055Z.json):
#   moving (glibc default)  881 MiB peak, 282 s wall, 495 CPU-s
#   fixed at 16 MiB         761 MiB (0.91x, no difference), 277 s (0.99x), 495 CPU-s (1.01x)
#   fixed at 4 MiB          652 MiB (0.74x), 341 s (1.20x), 622 CPU-s (1.26x: page faults of
#                           every batch's 4-16 MiB forward temporaries, mapped anew each time)
# So 16 MiB by default, and 4 MiB with --offload-activations (time traded for memory). Against
# depth (8 x 512): glibc's moving threshold 1.36x at 4x the layers; 16 MiB 1.13x
# (memory-20261201T152007Z.json) until LayerStream.unload_layer stopped making new parameter
# objects every layer, then flat: 1.04x, no difference (memory-20261201T174651Z.json).
MMAP_THRESHOLD = 16 << 20
MMAP_THRESHOLD_LOW = 4 << 20


def env_mmap_threshold() -> int | None:
    """The threshold a user fixed with ``MALLOC_MMAP_THRESHOLD_`` (glibc reads it at start)."""
    text = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(text) if text.isdigit() else None


def release_free_heap() -> None:
    """Give the allocator's free memory back after each layer. Every layer allocates and frees
    the same large tensors, and glibc malloc's dynamic mmap threshold moves them onto the heap,
    whose freed pages it keeps: measured on a 240-layer model, RssAnon then climbed by about
    6 MB per layer (600 -> 775 MB over 36 layers) and a run capped at 1 GiB was OOM-killed at
    layer 22, although nothing stays referenced. ``malloc_trim(0)`` (and tcmalloc's release
    when it is loaded) returns those pages, so the peak stays flat with depth."""
    for release in allocator_releasers().values():
        release()
