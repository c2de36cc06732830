"""A faithful torch reading of a quantized artifact: every quantized linear dequantized to float.

This is the reference the runtimes are compared against. The format comes from the registry by
the config's ``quant_method``; its ``dequantize`` turns one module's stored tensors into a
float weight [N, K] exactly as written on disk (GPTQ honours ``qzeros`` in either convention
and ``g_idx``).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..core.errors import CpuQuantError
from ..core.io.checkpoint import (
    Checkpoint,
    check_config_sizes,
    check_float_weights,
    empty_causal_lm,
    load_hf_config,
    open_checkpoint,
    tensors_disagree,
)
from ..formats import format_for_quant_method


def _dynamic_bits(qcfg: dict, module: str) -> int | None:
    """The bits the first positive ``dynamic`` rule matching ``module`` (a regular expression,
    as vLLM and GPTQModel match it) gives it, or None when no rule names bits."""
    for pattern, override in (qcfg.get("dynamic") or {}).items():
        if pattern.startswith("-:") or not isinstance(override, dict) or "bits" not in override:
            continue
        if re.match(pattern.removeprefix("+:"), module):
            return int(override["bits"])
    return None


def dequantized_state_dict(ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    qcfg = ckpt.config.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    state: dict[str, torch.Tensor] = {}
    if method is None:  # a float model: it must be one (the reference's NaN is refused here)
        check_float_weights(ckpt)
        return {n: ckpt.tensor(n, check_finite=True).to(dtype) for n in ckpt.names}
    fmt = format_for_quant_method(method)
    if fmt is None:
        raise CpuQuantError(f"unsupported quant_method {method!r}")
    modules = fmt.modules(ckpt)
    owned = {f"{m}.{s}" for m in modules for s in fmt.suffixes}
    for m in modules:
        bits = _dynamic_bits(qcfg, m)
        if bits not in (None, 4):
            raise CpuQuantError(f"{m}: {bits}-bit weights (the config's `dynamic` rules); only "
                                "4-bit modules can be read")
        # contiguous: a format may dequantize to a transposed view, and torch's bf16 matrix
        # product on such a weight takes a slow path (44x slower for a 1B model's MLP on an
        # AVX2 CPU without native bf16)
        state[f"{m}.weight"] = fmt.dequantize(fmt.read_tensors(ckpt, m), qcfg).to(
            dtype, memory_format=torch.contiguous_format)
    for n in ckpt.names:
        if n not in owned:
            state[n] = ckpt.tensor(n).to(dtype)
    return state


def _empty_model(ckpt: Checkpoint, dtype: torch.dtype):
    """(the model ``ckpt``'s config builds, without memory; whether its head is tied), or a
    one-line error for a config transformers cannot read or build, or whose sizes its tensors
    contradict (refused before the build: a config can state a billion layers)."""
    check_config_sizes(ckpt)
    config = load_hf_config(ckpt.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return empty_causal_lm(config, dtype), bool(getattr(config, "tie_word_embeddings", False))


def check_float_model(ckpt: Checkpoint) -> None:
    """Refuse, before any work, a float checkpoint that cannot be loaded: integer weights, or a
    config that transformers cannot build or that its tensors disagree with."""
    check_float_weights(ckpt)
    model, tied = _empty_model(ckpt, torch.float32)
    problem = tensors_disagree(model, {n: ckpt.shape(n) for n in ckpt.names}, tied)
    if problem:
        raise CpuQuantError(f"config disagrees with the tensors: {problem}")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """A transformers model holding the (dequantized) weights of ``path``; float or quantized.
    A config transformers cannot read or build, or one its tensors disagree with, is a
    one-line error."""
    ckpt = open_checkpoint(path)
    model, tied = _empty_model(ckpt, dtype)
    state = dequantized_state_dict(ckpt, dtype)
    problem = tensors_disagree(model, {n: tuple(t.shape) for n, t in state.items()}, tied)
    if problem:
        raise CpuQuantError(f"{path}: config disagrees with the tensors: {problem}")
    if tied and "lm_head.weight" not in state:
        emb = model.get_input_embeddings()
        emb_name = next(n for n, m in model.named_modules() if m is emb) + ".weight"
        state["lm_head.weight"] = state[emb_name]
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    ckpt.close()
    return model.eval()
