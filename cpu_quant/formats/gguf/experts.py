"""Mixture-of-experts in GGUF: llama.cpp's ``qwen3moe`` (convert_hf_to_gguf.py's
``Qwen3MoeModel``, a ``Qwen2MoeModel``).

The run hands the sink one result per expert projection, under the checkpoint's names
(``model.layers.L.mlp.experts.E.gate_proj``); llama.cpp reads each projection of a layer as one
3-D tensor, the experts stacked on the outermost axis, as the converter's ``torch.stack`` of the
per-expert tensors in expert order:

=========================  ===============  ====================  ============================
GGUF tensor                type             ggml shape ``ne``     content
=========================  ===============  ====================  ============================
``blk.L.ffn_gate_exps``    Q4_0             [H, F, E]             expert ``e``'s gate_proj rows
                                                                  [F, H/32] blocks, e = 0..E-1
``blk.L.ffn_up_exps``      Q4_0             [H, F, E]             the same for up_proj
``blk.L.ffn_down_exps``    Q4_0             [F, H, E]             down_proj, [H, F/32] blocks
``blk.L.ffn_gate_inp``     F32              [H, E]                the router (``mlp.gate``):
                                                                  kept float, as the converter
                                                                  writes it (F32 holds bf16)
=========================  ===============  ====================  ============================

(``H`` hidden size, ``F`` ``moe_intermediate_size``, ``E`` experts; an expert projection the plan
keeps float is stacked the same way in BF16.) Metadata, as the converter writes it:
``{arch}.expert_count``, ``{arch}.expert_used_count``, ``{arch}.expert_feed_forward_length``.

llama.cpp's qwen3moe graph (``src/models/qwen3moe.cpp``) has an MoE MLP in every layer and always
renormalises the top-k routing weights (``build_moe_ffn(..., norm_w = true, ...)``, softmax
gating): a checkpoint with dense layers (``mlp_only_layers``, ``decoder_sparse_step`` > 1) or
``norm_topk_prob`` false would run as another model there, and is refused.
"""

from __future__ import annotations

import gguf
import torch

from ...core.experts import expert_count, experts_per_token, split_expert_name

ROUTER_LEAF = "mlp.gate"  # the router's module, relative to its layer
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def moe_keys(w: gguf.GGUFWriter, cfg: dict) -> None:
    w.add_expert_count(expert_count(cfg))
    w.add_expert_used_count(experts_per_token(cfg))
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))


def refuse_qwen3_moe(cfg: dict) -> str | None:
    """Why llama.cpp's qwen3moe graph would not compute this checkpoint's model, or None."""
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        return ("llama.cpp's qwen3moe has an MoE MLP in every layer; this model has dense ones "
                "(mlp_only_layers / decoder_sparse_step)")
    if not cfg.get("norm_topk_prob", False):
        return ("llama.cpp's qwen3moe always renormalises the top-k routing weights; this model "
                "does not (norm_topk_prob false)")
    return None


def is_router(hf_name: str) -> bool:
    """``model.layers.L.mlp.gate.weight``: the router, stored F32 as the converter does."""
    return hf_name.endswith("." + ROUTER_LEAF + ".weight")


def stacked_name(hf_name: str) -> tuple[str, int] | None:
    """(the stacked tensor's HF-style name, as the converter names it before mapping, e.g.
    ``model.layers.3.mlp.experts.up_proj.weight``; the expert) of one expert projection's part
    tensor (``...experts.5.up_proj`` for a Q4_0 module, ``...experts.5.up_proj.weight`` for a
    float one); None for any other tensor."""
    parts = split_expert_name(hf_name.removesuffix(".weight"))
    if parts is None or parts[2] not in EXPERT_PROJECTIONS:
        return None
    block, e, proj = parts
    return f"{block}.{proj}.weight", e


def expected_moe_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """A layer's MoE tensors (relative names) and their ggml shapes ``ne``."""
    hidden, ff, n = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"]), expert_count(cfg)
    return {"ffn_gate_inp": (hidden, n), "ffn_gate_exps": (hidden, ff, n),
            "ffn_up_exps": (hidden, ff, n), "ffn_down_exps": (ff, hidden, n)}


def expert_modules(names: gguf.TensorNameMap, n_layers: int) -> dict[str, str]:
    """GGUF stacked tensor name -> the HF module prefix of its experts with ``{}`` for the
    expert (``model.layers.0.mlp.experts.{}.gate_proj``)."""
    out = {}
    for i in range(n_layers):
        for proj in EXPERT_PROJECTIONS:
            g = names.get_name(f"model.layers.{i}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))
            if g is not None:
                out[g] = f"model.layers.{i}.mlp.experts.{{}}.{proj}"
    return out


def unstack(blocks: torch.Tensor) -> list[torch.Tensor]:
    """A stacked tensor's raw data [E, N, bytes] as one [N, bytes] tensor per expert."""
    return list(blocks.unbind(0))
