"""Activation smoothing of the static graph for the 8-bit dynamic-activation scheme (8da8w).

``quantize.smoothing`` gives the per-channel factors; this applies them where the static graph
(``model.StaticCausalLM``) lets the division be folded exactly, for every linear:

* ``q/k/v_proj`` and ``gate/up_proj`` read a norm's output: the norm's weight is divided;
* ``down_proj`` reads ``silu(gate) · up``: ``up_proj``'s rows are divided;
* ``o_proj`` reads the attention output, a mix of ``v_proj``'s rows: those are divided (and
  its bias). With grouped-query attention one ``v`` channel feeds ``n_heads / n_kv_heads``
  ``o_proj`` inputs, which therefore share its factor;
* ``lm_head`` reads the final norm's output: that norm's weight is divided.

The float model computes the same logits (to float rounding); what changes is where the range
sits: smoothed activations, wider weights. Used for 8da8w only: its 8-bit weights are chosen
after smoothing, while 8da4w's 4-bit weights are the GPTQ codes of the unsmoothed model.
"""

from __future__ import annotations

import torch

from ..quantize.smoothing import DEFAULT_ALPHA, smoothing_scales
from .model import StaticCausalLM
from .weights import ChannelStats


def _scale_columns(linear: torch.nn.Linear, s: torch.Tensor) -> None:
    linear.weight.data = linear.weight.data * s.unsqueeze(0)


def _divide_rows(linear: torch.nn.Linear, s: torch.Tensor) -> None:
    linear.weight.data = linear.weight.data / s.unsqueeze(1)
    if linear.bias is not None:
        linear.bias.data = linear.bias.data / s


def _rescaled(stats: ChannelStats, s: torch.Tensor) -> ChannelStats:
    return ChannelStats(stats.mean_sq / (s * s), stats.abs_max / s)


@torch.no_grad()
def smooth_static_lm(model: StaticCausalLM, stats: dict[str, ChannelStats],
                     alpha: float = DEFAULT_ALPHA) -> dict[str, ChannelStats]:
    """Smooth ``model`` in place; the statistics of the smoothed inputs, by linear name."""
    out = dict(stats)

    def norm_fed(norm: torch.nn.Module, prefix: str, names: tuple[str, ...]) -> None:
        linears = [model.get_submodule(prefix + n) for n in names]
        st = stats[prefix + names[0]]
        s = smoothing_scales(st.abs_max, [lin.weight for lin in linears], alpha)
        norm.weight.data = norm.weight.data / s
        for name, lin in zip(names, linears, strict=True):
            _scale_columns(lin, s)
            out[prefix + name] = _rescaled(stats[prefix + name], s)

    spec = model.spec
    rep, d = spec.n_heads // spec.n_kv_heads, spec.head_dim
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        norm_fed(layer.input_layernorm, p + "self_attn.", ("q_proj", "k_proj", "v_proj"))
        norm_fed(layer.post_attention_layernorm, p + "mlp.", ("gate_proj", "up_proj"))

        st = stats[p + "mlp.down_proj"]
        s = smoothing_scales(st.abs_max, [mlp.down_proj.weight], alpha)
        _divide_rows(mlp.up_proj, s)
        _scale_columns(mlp.down_proj, s)
        out[p + "mlp.down_proj"] = _rescaled(st, s)

        # o_proj input channel (h, j) comes from v channel (h // rep, j): group the rep heads
        st = stats[p + "self_attn.o_proj"]
        n_out = attn.o_proj.out_features
        a_grouped = st.abs_max.view(spec.n_kv_heads, rep, d).amax(1).reshape(-1)
        w_grouped = (attn.o_proj.weight.view(n_out, spec.n_kv_heads, rep, d)
                     .permute(0, 2, 1, 3).reshape(n_out * rep, spec.n_kv_heads * d))
        s_v = smoothing_scales(a_grouped, [w_grouped], alpha)
        s_o = s_v.view(spec.n_kv_heads, 1, d).expand(spec.n_kv_heads, rep, d).reshape(-1)
        _divide_rows(attn.v_proj, s_v)
        _scale_columns(attn.o_proj, s_o)
        out[p + "self_attn.o_proj"] = _rescaled(st, s_o)

    st = stats["lm_head"]
    s = smoothing_scales(st.abs_max, [model.lm_head.weight], alpha)
    model.norm.weight.data = model.norm.weight.data / s
    _scale_columns(model.lm_head, s)
    out["lm_head"] = _rescaled(st, s)
    return out
