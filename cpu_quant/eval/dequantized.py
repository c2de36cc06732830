"""A faithful torch reading of a quantized artifact: every quantized linear dequantized to float.

This is the reference the runtimes are compared against. Layout readers are registered by the
config's ``quant_method``; each turns one module's stored tensors into a float weight
[N, K] exactly as written on disk (GPTQ honours ``qzeros`` in either convention and ``g_idx``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import CpuQuantError
from ..io.checkpoint import Checkpoint, open_checkpoint
from ..quantize.gptq_cpu_export import TENSORS as GPTQ_TENSORS
from ..quantize.gptq_cpu_export import dequantize_gptq

# quant_method -> (marker suffix of a quantized module, reader(ckpt, module, qcfg) -> weight)
ModuleReader = Callable[[Checkpoint, str, dict], torch.Tensor]
READERS: dict[str, tuple[str, tuple[str, ...], ModuleReader]] = {}
# Layouts whose module registers its reader on import; imported on first use, so that reading a
# checkpoint never depends on which cpu_quant modules happen to be imported already.
LAZY_READERS = {"cpu_int4": "cpu_quant.quantize.tinygemm_pack"}


def register_reader(quant_method: str, marker: str, suffixes: tuple[str, ...],
                    reader: ModuleReader) -> None:
    READERS[quant_method] = (marker, suffixes, reader)


def _read_gptq(ckpt: Checkpoint, module: str, qcfg: dict) -> torch.Tensor:
    if int(qcfg.get("bits", 4)) != 4:
        raise CpuQuantError(f"only 4-bit GPTQ is supported (config says {qcfg.get('bits')})")
    g_idx = ckpt.tensor(f"{module}.g_idx") if f"{module}.g_idx" in ckpt.files else None
    return dequantize_gptq(ckpt.tensor(f"{module}.qweight"), ckpt.tensor(f"{module}.qzeros"),
                           ckpt.tensor(f"{module}.scales"), g_idx,
                           qcfg.get("checkpoint_format", "gptq"))


register_reader("gptq", "qweight", GPTQ_TENSORS, _read_gptq)


def reader_for(quant_method: str) -> tuple[str, tuple[str, ...], ModuleReader]:
    """(marker, suffixes, reader) of ``quant_method``, importing its layout module if needed."""
    if quant_method not in READERS and quant_method in LAZY_READERS:
        import importlib

        importlib.import_module(LAZY_READERS[quant_method])
    if quant_method not in READERS:
        known = sorted(set(READERS) | set(LAZY_READERS))
        raise CpuQuantError(f"unsupported quant_method {quant_method!r} "
                            f"(known: {', '.join(known)})")
    return READERS[quant_method]


def dequantized_state_dict(ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    qcfg = ckpt.config.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    state: dict[str, torch.Tensor] = {}
    if method is None:
        return {n: ckpt.tensor(n).to(dtype) for n in ckpt.names}
    marker, suffixes, reader = reader_for(method)
    modules = [n[: -len(marker) - 1] for n in ckpt.names if n.endswith("." + marker)]
    owned = {f"{m}.{s}" for m in modules for s in suffixes}
    for m in modules:
        state[f"{m}.weight"] = reader(ckpt, m, qcfg).to(dtype)
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
