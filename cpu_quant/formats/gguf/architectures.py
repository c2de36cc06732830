"""The architecture map: which Hugging Face models the GGUF writer takes, and the hyperparameters
and row permutations llama.cpp expects of each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import torch

from ...core.errors import CpuQuantError
from .experts import moe_keys, refuse_qwen3_moe

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def permute_rope_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's half-split rope rows -> llama.cpp's interleaved order, per head (any row payload)."""
    n = rows.shape[0]
    return rows.reshape(n_head, 2, n // n_head // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def unpermute_rope_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`permute_rope_rows`."""
    n = rows.shape[0]
    return rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


# -- architectures -------------------------------------------------------------------------------
def _rope_theta(cfg: dict, kind: str = "full_attention") -> float | None:
    if cfg.get("rope_theta") is not None and kind == "full_attention":
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    if kind in params:
        params = params[kind]
    elif kind != "full_attention":
        return None
    theta = params.get("rope_theta")
    return None if theta is None else float(theta)


def _gemma2_keys(w: gguf.GGUFWriter, cfg: dict) -> None:
    if cfg.get("attn_logit_softcapping") is not None:
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
    if cfg.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("sliding_window") is not None:
        w.add_sliding_window(int(cfg["sliding_window"]))


def _gemma3_keys(w: gguf.GGUFWriter, cfg: dict) -> None:
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("sliding_window_pattern") != 1 and cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
    if (swa := _rope_theta(cfg, "sliding_attention")) is not None:
        w.add_rope_freq_base_swa(swa)
    rope = (cfg.get("rope_parameters") or {}).get("full_attention") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "linear" and rope.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))


def _llama_keys(w: gguf.GGUFWriter, cfg: dict) -> None:
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_rope_dimension_count(_head_dim(cfg))


@dataclass(frozen=True)
class ArchSpec:
    """How one Hugging Face architecture becomes a llama.cpp one (convert_hf_to_gguf.py's class)."""

    arch: gguf.MODEL_ARCH
    rope_permute: bool  # llama's interleaved ("NORM") rope: Q/K rows permuted per head
    norm_shift: float  # Gemma's RMSNorm multiplies by (1 + w): stored as 1 + w
    head_tensor: bool  # the arch has an ``output`` tensor (Gemma 2 always reads token_embd)
    extra_keys: Callable[[gguf.GGUFWriter, dict], None] | None = None
    # why llama.cpp's graph of the arch would compute another model than this config's, or None
    refuse: Callable[[dict], str | None] | None = None

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


_LLAMA = ArchSpec(gguf.MODEL_ARCH.LLAMA, True, 0.0, True, _llama_keys)
# architectures[0] of config.json -> spec; evidence: the converter's class for each
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": _LLAMA,  # LlamaModel
    "MistralForCausalLM": _LLAMA,  # registered under LlamaModel ("llama")
    "Qwen2ForCausalLM": ArchSpec(gguf.MODEL_ARCH.QWEN2, False, 0.0, True),  # Qwen2Model, NEOX rope
    "Qwen3ForCausalLM": ArchSpec(gguf.MODEL_ARCH.QWEN3, False, 0.0, True),  # Qwen3Model
    "Gemma2ForCausalLM": ArchSpec(gguf.MODEL_ARCH.GEMMA2, False, 1.0, False, _gemma2_keys),
    "Gemma3ForCausalLM": ArchSpec(gguf.MODEL_ARCH.GEMMA3, False, 1.0, True, _gemma3_keys),
    # Qwen3MoeModel (a Qwen2MoeModel): experts stacked, the router F32 (experts.py)
    "Qwen3MoeForCausalLM": ArchSpec(gguf.MODEL_ARCH.QWEN3MOE, False, 0.0, True, moe_keys,
                                    refuse_qwen3_moe),
}


def arch_spec(cfg: dict) -> ArchSpec:
    """The spec of ``cfg``'s architecture, or a one-line error naming the ones supported."""
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else cfg.get("model_type", "?")
    spec = ARCHITECTURES.get(name)
    if spec is None:
        raise CpuQuantError(f"gguf: architecture {name} is not supported (supported: "
                            f"{', '.join(ARCHITECTURES)})")
    if spec.refuse is not None and (why := spec.refuse(cfg)):
        raise CpuQuantError(f"gguf: {why}")
    return spec


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _write_hyperparameters(w: gguf.GGUFWriter, spec: ArchSpec, cfg: dict,
                           file_type: gguf.LlamaFileType) -> None:
    """The ``{arch}.*`` hyperparameters and ``general.file_type``, in the order every earlier
    release wrote them (the file's bytes depend on the keys' order)."""
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if (theta := _rope_theta(cfg)) is not None:
        w.add_rope_freq_base(theta)
    if cfg.get("head_dim") is not None:  # as the converter: whenever config.json states it
        w.add_key_length(int(cfg["head_dim"]))
        w.add_value_length(int(cfg["head_dim"]))
    w.add_file_type(file_type)
    if spec.extra_keys is not None:
        spec.extra_keys(w, cfg)
