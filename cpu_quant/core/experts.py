"""Mixture-of-experts layers, one ``nn.Linear`` per expert projection.

transformers 5 builds a Qwen3-MoE layer's experts as one module holding two 3-D parameters
(``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]) and converts the checkpoint's per-expert
tensors (``mlp.experts.{e}.gate_proj.weight`` ...) into them at load time; it saves them back per
expert. cpu-quant reads the checkpoint tensor by tensor and quantizes ``nn.Linear`` modules, so
:func:`unfuse_experts` puts :class:`ExpertList` in place of the fused module: one
:class:`ExpertMLP` per expert, named as the checkpoint names the tensors, computing what the fused
module computes (the same per-expert loop over the tokens the router sends, scaled by their
routing weights and added in expert order). Each expert's linears then see only their own
tokens, which is what per-expert GPTQ calibrates on (``quantize/experts.py``).

The router (``mlp.gate``, a parameter of a module that is not an ``nn.Linear``) is never
quantized: it stays bf16 in every format (llama.cpp's converter writes it as F32, which holds the
bf16 values exactly).

Supported: the fused expert classes in :data:`FUSED_EXPERTS` (the checkpoint's leaf names of
each). Another mixture-of-experts class is refused in one line.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .errors import CpuQuantError

# fused experts class -> the checkpoint's per-expert projection names (gate, up, down)
FUSED_EXPERTS: dict[str, tuple[str, str, str]] = {
    "Qwen3MoeExperts": ("gate_proj", "up_proj", "down_proj"),
}
# model_type -> the family's name in messages and docs
MOE_FAMILIES = {"qwen3_moe": "Qwen3-MoE"}
EXPERT_RE = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[a-z_0-9]+)$")


def expert_count(config: dict) -> int:
    """Routed experts per layer of a config.json (its text config's), 0 for a dense model."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            for key in ("num_experts", "num_local_experts", "n_routed_experts"):
                value = cfg.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return 0


def experts_per_token(config: dict) -> int:
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("num_experts_per_tok"), int):
            return int(cfg["num_experts_per_tok"])
    return 0


def moe_family(config: dict) -> str | None:
    """The mixture-of-experts family's name, None for a dense model; a one-line refusal for a
    mixture-of-experts model of another family."""
    if not expert_count(config):
        return None
    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    if model_type not in MOE_FAMILIES:
        raise CpuQuantError(f"mixture-of-experts model_type {model_type!r} is not supported "
                            f"(supported: {', '.join(MOE_FAMILIES)})")
    return MOE_FAMILIES[model_type]


def refuse_experts(config: dict, why: str) -> str | None:
    """A format's refusal of a mixture-of-experts model: ``"<family> experts: <why>"``, the
    one-line refusal of an unsupported family, or None for a dense model."""
    try:
        family = moe_family(config)
    except CpuQuantError as exc:
        return str(exc)
    return None if family is None else f"{family} experts: {why}"


def split_expert_name(module: str) -> tuple[str, int, str] | None:
    """``model.layers.3.mlp.experts.7.up_proj`` -> (``model.layers.3.mlp.experts``, 7,
    ``up_proj``); None for a module outside an expert."""
    m = EXPERT_RE.match(module)
    return None if m is None else (m["block"], int(m["expert"]), m["proj"])


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``, its linears named as the checkpoint's."""

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str], act: nn.Module,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        kw = {"bias": False, "device": device, "dtype": dtype}
        setattr(self, gate, nn.Linear(hidden, intermediate, **kw))
        setattr(self, up, nn.Linear(hidden, intermediate, **kw))
        setattr(self, down, nn.Linear(intermediate, hidden, **kw))
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class ExpertList(nn.ModuleList):
    """The experts of one layer, called as the fused module is: ``(hidden [T, H], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, H]``."""

    def __init__(self, experts: list[ExpertMLP]) -> None:
        super().__init__(experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=len(self)).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            pos, tokens = torch.where(mask[e])
            y = self[e](hidden_states[tokens]) * top_k_weights[tokens, pos, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


def unfuse_experts(model: nn.Module) -> int:
    """Put an :class:`ExpertList` in place of every fused experts module of ``model`` (on the
    fused module's device: meta for an empty model); the number replaced. A module holding
    3-D expert weights of a class not in :data:`FUSED_EXPERTS` is refused in one line."""
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            params = dict(child.named_parameters(recurse=False))
            if not any(p.dim() == 3 for p in params.values()):
                continue
            kind = type(child).__name__
            if kind not in FUSED_EXPERTS:
                raise CpuQuantError(f"mixture-of-experts module {kind} is not supported "
                                    f"(supported: {', '.join(FUSED_EXPERTS)})")
            gate_up, down = params["gate_up_proj"], params["down_proj"]
            n, hidden, inter = gate_up.shape[0], gate_up.shape[2], down.shape[2]
            experts = [ExpertMLP(hidden, inter, FUSED_EXPERTS[kind], child.act_fn,
                                 gate_up.device, gate_up.dtype) for _ in range(n)]
            setattr(parent, child_name, ExpertList(experts))
            replaced += 1
    return replaced
