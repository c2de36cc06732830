"""A decode-capable decoder-only LM with a static KV cache and static shapes, for export.

Built from a Hugging Face checkpoint of the Llama family (``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``); anything else is refused
with a one-line error. Weights are read lazily from safetensors (``io.checkpoint``) and held in
float32, the precision every exported arm starts from.

One call processes ``T`` tokens (``T`` fixed per exported method: the prefill length, or 1 for
decode). Inputs and outputs, batch 1, all static:

* ``tokens``  int64   [1, T]               token ids (padding rows use id 0);
* ``input_pos`` int64 [T]                  position of each row, indexes the RoPE tables;
* ``mask``    float32 [1, 1, T, C + T]     additive: 0 where a row may attend, ``MASK_VALUE``
  where not; columns ``0..C-1`` are cache slots, ``C..C+T-1`` this call's own tokens;
* ``k_cache``/``v_cache`` float32 [L, H_kv, C, D]  cache slot ``j`` holds position ``j``;
* outputs: ``logits`` float32 [1, T, V], ``k_new``/``v_new`` float32 [L, H_kv, T, D] — the keys
  and values of this call's rows, which the host writes into slots ``pos..pos+n-1``.

``C`` is ``max_seq_len``. Keeping the cache update on the host keeps the graph free of
data-dependent writes (``index_put``), which is what lets the same graph be quantized by the
QNN quantizer, lowered to the HTP and run on XNNPACK or the portable kernels unchanged (the same
I/O contract as ExecuTorch's Qualcomm static Llama).

``MASK_VALUE`` is -255 rather than -inf: with 16-bit activations the mask is a quantized tensor,
and -inf would destroy its scale; exp(-255) is 0 in float32 anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import CpuQuantError
from ..core.io.checkpoint import Checkpoint, open_checkpoint, read_config
from .graph import GraphShape

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
# RoPE variants whose tables do not depend on the sequence length seen at run time.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class DecoderSpec:
    """The architecture facts the static graph needs, read from ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    qk_norm: bool
    tie_embeddings: bool
    max_context: int
    sliding_window: int | None


def read_spec(src: str | Path) -> DecoderSpec:
    """Validate the architecture in ``src/config.json``; one-line error when unsupported."""
    cfg_path = Path(src) / "config.json"
    cfg = read_config(Path(src))
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CpuQuantError(f"export-phone supports {', '.join(SUPPORTED_ARCHITECTURES)}; "
                            f"this checkpoint is {arch or 'of unknown architecture'}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CpuQuantError(f"export-phone supports SiLU-gated MLPs; this model uses {act}")
    def positive(key: str, default: int | None = None) -> int:
        value = cfg.get(key) if cfg.get(key) is not None else default
        if value is None:
            raise CpuQuantError(f"{cfg_path}: {key} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CpuQuantError(f"{cfg_path}: {key} must be a positive integer, not {value!r}")
        return value

    n_heads = positive("num_attention_heads")
    hidden = positive("hidden_size")
    if hidden % n_heads and cfg.get("head_dim") is None:
        raise CpuQuantError(f"{cfg_path}: hidden_size {hidden} is not a multiple of "
                            f"num_attention_heads {n_heads}")
    eps = cfg.get("rms_norm_eps")  # a finite number >= 0 or null (read_config checked it)
    eps = 1e-6 if eps is None else eps
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if sliding is not None:
        sliding = positive("sliding_window")
    return DecoderSpec(
        architecture=arch,
        vocab_size=positive("vocab_size"),
        hidden_size=hidden,
        n_layers=positive("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=positive("num_key_value_heads", n_heads),
        head_dim=positive("head_dim", hidden // n_heads),
        intermediate_size=positive("intermediate_size"),
        rms_eps=float(eps),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_context=positive("max_position_embeddings", 2048),
        sliding_window=sliding,
    )


def check_max_seq_len(spec: DecoderSpec, max_seq_len: int) -> None:
    if max_seq_len < 2:
        raise CpuQuantError(f"--max-seq-len must be at least 2, got {max_seq_len}")
    if max_seq_len > spec.max_context:
        raise CpuQuantError(f"--max-seq-len {max_seq_len} is beyond the model's context of "
                            f"{spec.max_context} tokens (max_position_embeddings)")
    if spec.sliding_window is not None and max_seq_len > spec.sliding_window:
        # The static graph attends to the whole cache; past the window that is a different model.
        raise CpuQuantError(f"--max-seq-len {max_seq_len} is beyond the model's sliding window "
                            f"of {spec.sliding_window} tokens, which the static graph does not model")


def rope_tables(src: str | Path, spec: DecoderSpec, max_seq_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_seq_len, head_dim] in HF's rotate-half convention.

    Inverse frequencies come from transformers' own RoPE initialisers, so scaled variants
    (llama3, yarn, ...) match the reference model exactly.
    """
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(src)
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise CpuQuantError(f"RoPE type {rope_type!r} is not supported by the static graph")
    if rope_type == "default":
        theta = float(params.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32)
                                    / spec.head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    pos = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.to(torch.float32))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class RMSNorm(nn.Module):
    """``aten.rms_norm`` (one op, which the QNN quantizer annotates and the HTP runs), or, with
    ``mean4d`` set, the same math written with a 4-D mean over the innermost dims, the only
    mean XNNPACK delegates (executorch 1.5.1 ``MeanDimConfig``); otherwise each norm splits the
    XNNPACK partition (measured: 10 partitions per method for 4 layers instead of 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.mean4d = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mean4d:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        shape = x.shape
        sq = (x * x).reshape(1, -1, 1, shape[-1]).mean(dim=(2, 3), keepdim=True)
        return x * torch.rsqrt(sq.reshape(*shape[:-1], 1) + self.eps) * self.weight


def use_mean4d_norms(model: nn.Module) -> None:
    """Switch every RMSNorm to the XNNPACK-delegable form (same math, see ``RMSNorm``)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.mean4d = True


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        h, kv, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.n_heads, self.n_kv, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=qkv_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(d, spec.rms_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        q = self.q_proj(x).view(t, h, d).transpose(0, 1)  # [H, T, D]
        k = self.k_proj(x).view(t, kv, d).transpose(0, 1)  # [Hkv, T, D]
        v = self.v_proj(x).view(t, kv, d).transpose(0, 1)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys = torch.cat((k_cache, k), dim=1)  # [Hkv, C+T, D]
        values = torch.cat((v_cache, v), dim=1)
        # Grouped-query attention without repeating K/V: query head i uses KV head i // rep
        # (HF's repeat_kv order), so fold the rep query heads of a group into the row axis.
        rep = h // kv
        qg = q.reshape(kv, rep * t, d)
        scores = torch.bmm(qg, keys.transpose(1, 2)) * (d ** -0.5)  # [Hkv, rep*T, C+T]
        scores = scores.view(kv, rep, t, -1) + mask[0]
        probs = torch.softmax(scores, dim=-1).view(kv, rep * t, -1)
        out = torch.bmm(probs, values).view(h, t, d).transpose(0, 1).reshape(t, h * d)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.self_attn = Attention(spec, qkv_bias, o_bias)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class StaticCausalLM(nn.Module):
    """The exported graph: see the module docstring for the exact I/O contract."""

    def __init__(self, spec: DecoderSpec, max_seq_len: int, cos: torch.Tensor, sin: torch.Tensor,
                 qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.max_seq_len = max_seq_len
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, qkv_bias, o_bias)
                                    for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embed_tokens(tokens[0])  # [T, hidden]
        cos = torch.index_select(self.rope_cos, 0, input_pos)  # [T, D]
        sin = torch.index_select(self.rope_sin, 0, input_pos)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, mask, k_cache[i], v_cache[i])
            ks.append(k)
            vs.append(v)
        logits = self.lm_head(self.norm(x))
        return logits.unsqueeze(0), torch.stack(ks), torch.stack(vs)


# HF tensor name (after "model.layers.{i}.") -> our parameter name (after "layers.{i}.")
_LAYER_TENSORS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.q_norm.weight": "self_attn.q_norm.weight",
    "self_attn.k_norm.weight": "self_attn.k_norm.weight",
    **{f"self_attn.{p}_proj.{w}": f"self_attn.{p}_proj.{w}"
       for p in "qkvo" for w in ("weight", "bias")},
    **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


def _tensor(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in ckpt.files:
        raise CpuQuantError(f"checkpoint is missing tensor {name}")
    if ckpt.shape(name) != shape:
        raise CpuQuantError(f"config disagrees with the tensors: {name} has shape "
                            f"{list(ckpt.shape(name))}, the config implies {list(shape)}")
    return ckpt.tensor(name, check_finite=True).to(torch.float32)


def load_static_lm(src: str | Path, max_seq_len: int) -> StaticCausalLM:
    """The float32 static graph with the checkpoint's weights (embedding and head untied)."""
    spec = read_spec(src)
    check_max_seq_len(spec, max_seq_len)
    ckpt = open_checkpoint(src)
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in ckpt.files
    o_bias = "model.layers.0.self_attn.o_proj.bias" in ckpt.files
    cos, sin = rope_tables(src, spec, max_seq_len)
    with torch.device("meta"):
        model = StaticCausalLM(spec, max_seq_len, cos, sin, qkv_bias, o_bias)
    state: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for i in range(spec.n_layers):
        for hf, ours in _LAYER_TENSORS.items():
            name = f"layers.{i}.{ours}"
            if name in params:
                state[name] = _tensor(ckpt, f"model.layers.{i}.{hf}", tuple(params[name].shape))
    shape_embed = (spec.vocab_size, spec.hidden_size)
    state["embed_tokens.weight"] = _tensor(ckpt, "model.embed_tokens.weight", shape_embed)
    state["norm.weight"] = _tensor(ckpt, "model.norm.weight", (spec.hidden_size,))
    if "lm_head.weight" in ckpt.files:
        state["lm_head.weight"] = _tensor(ckpt, "lm_head.weight", shape_embed)
    elif spec.tie_embeddings:
        # Untied copy: the quantizers give the head (a matmul) and the embedding (a gather)
        # different weight formats, which one shared tensor could not carry.
        state["lm_head.weight"] = state["embed_tokens.weight"].clone()
    else:
        raise CpuQuantError("checkpoint is missing tensor lm_head.weight")
    ckpt.close()
    model.load_state_dict(state, strict=True, assign=True)
    model.register_buffer("rope_cos", cos, persistent=False)
    model.register_buffer("rope_sin", sin, persistent=False)
    return model.eval()


def export_methods(modules: Mapping[str, nn.Module], shape: GraphShape
                   ) -> dict[str, torch.export.ExportedProgram]:
    """``torch.export`` each method's module with its static example inputs."""
    lengths = shape.methods()
    with torch.no_grad():
        return {name: torch.export.export(module, shape.example_inputs(lengths[name]),
                                          strict=False)
                for name, module in modules.items()}
