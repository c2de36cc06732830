"""A faithful torch reading of a quantized artifact: every quantized linear dequantized to float.

This is the reference the runtimes are compared against. The format comes from the registry by
the config's ``quant_method``; its ``dequantize`` turns one module's stored tensors into a
float weight [N, K] exactly as written on disk (GPTQ honours ``qzeros`` in either convention
and ``g_idx``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CpuQuantError
from ..formats import format_for_quant_method
from ..io.checkpoint import Checkpoint, open_checkpoint


def dequantized_state_dict(ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    qcfg = ckpt.config.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    state: dict[str, torch.Tensor] = {}
    if method is None:
        return {n: ckpt.tensor(n).to(dtype) for n in ckpt.names}
    fmt = format_for_quant_method(method)
    if fmt is None:
        raise CpuQuantError(f"unsupported quant_method {method!r}")
    modules = fmt.modules(ckpt)
    owned = {f"{m}.{s}" for m in modules for s in fmt.suffixes}
    for m in modules:
        state[f"{m}.weight"] = fmt.dequantize(fmt.read_tensors(ckpt, m), qcfg).to(dtype)
    for n in ckpt.names:
        if n not in owned:
            state[n] = ckpt.tensor(n).to(dtype)
    return state


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """A transformers model holding the (dequantized) weights of ``path``; float or quantized."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = open_checkpoint(path)
    config = AutoConfig.from_pretrained(ckpt.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = dequantized_state_dict(ckpt, dtype)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        emb = model.get_input_embeddings()
        emb_name = next(n for n, m in model.named_modules() if m is emb) + ".weight"
        state["lm_head.weight"] = state[emb_name]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        bad = (missing or unexpected)[0]
        kind = "missing" if missing else "unexpected"
        raise CpuQuantError(f"{path}: tensors and config disagree ({kind} {bad})")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    ckpt.close()
    return model.eval()
