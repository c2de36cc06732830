"""Per-expert GPTQ of mixture-of-experts layers: whose tokens calibrate each expert, and the
fallback of an expert the router starves.

Each expert's linears are calibrated on the tokens the router sends to that expert, and on no
other: the experts are one ``nn.Linear`` per projection (``core.experts.ExpertList``) and the
layer's Hessian hooks see, for each expert, only the rows the router dispatched to it. The
Hessian is *plain*: ``2 XᵀX / n`` over those tokens, each counted once, not weighted by its
routing weight. Weighting by the squared
routing weight would be the exact second-order loss of the layer's output, but after top-k
renormalisation the weights of a token's experts are of one order (1/k on average), so it
changes which tokens count little, and a plain Hessian is the one a token-count rule speaks
about.

**Fallback.** A Hessian of ``n`` tokens has rank at most ``n``: an expert that received fewer
tokens than the widest input of its linears (the hidden size for gate and up, the expert's
intermediate size for down) would be fitted by GPTQ to a subspace of its inputs, and the
damping alone decides the rest. Such an expert (all three of its linears) is quantized by
round-to-nearest with the scale search weighted by the diagonal of the Hessian of the tokens it
did receive (unweighted when it received none), without GPTQ's error compensation. The report
records it (``gptq_fallback`` of its tensors, :data:`FALLBACK`) and every expert's token count
(``QuantReport.experts``). Every rank of a distributed run takes the same decision: the counts
are the summed Hessians' row counts.

The router (``mlp.gate``) is not a linear of the plan: it stays bf16 (``core.experts``).
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from ..core.experts import ExpertList, split_expert_name

FALLBACK = "rtn-few-tokens"
RULE = ("an expert with fewer routed tokens than the widest input of its linears is quantized "
        "by round-to-nearest with the scale search weighted by its tokens' Hessian diagonal, "
        "not by GPTQ")
HESSIAN = "plain: 2 XᵀX / n over the tokens the router sends to the expert, each counted once"
ROUTER = ("the router (mlp.gate) is kept bf16: it picks the experts, and 4-bit router weights "
          "would change which experts run")


def has_experts(layer: nn.Module) -> bool:
    return any(isinstance(m, ExpertList) for m in layer.modules())


def expert_tokens(linears: dict[str, nn.Linear], rows: dict[str, int],
                  min_tokens: int | None = None) -> dict[str, dict[int, tuple[int, int]]]:
    """Per experts block: expert -> (tokens routed to it, the tokens it needs for GPTQ: the
    widest input of its linears, or ``min_tokens`` when given). ``rows``: the rows each
    linear's Hessian summed (absent: the linear saw no token)."""
    blocks: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
    for name, m in linears.items():
        parts = split_expert_name(name)
        if parts is None:
            continue
        block, e, _ = parts
        tokens, width = blocks[block].get(e, (0, 0))
        # gate and up see the expert's tokens; down sees the same tokens (its rows are theirs)
        need = m.in_features if min_tokens is None else min_tokens
        blocks[block][e] = (max(tokens, rows.get(name, 0)), max(width, need))
    return dict(blocks)


def starved_experts(blocks: dict[str, dict[int, tuple[int, int]]]) -> dict[str, list[int]]:
    """Per experts block, the experts that received fewer tokens than their widest input."""
    return {block: sorted(e for e, (tokens, width) in experts.items() if tokens < width)
            for block, experts in blocks.items()}


def fallbacks(linears: dict[str, nn.Linear], rows: dict[str, int], gptq: bool = True,
              min_tokens: int | None = None) -> tuple[dict[str, str], dict[str, dict]]:
    """The fallback of every linear of a starved expert (module name -> :data:`FALLBACK`),
    and the layer's record for the report: per experts block, each expert's token count and
    the experts that fell back (none when the run is not GPTQ: every linear is then
    round-to-nearest already). ``min_tokens``: ``QuantSettings.expert_min_tokens``."""
    blocks = expert_tokens(linears, rows, min_tokens)
    starved = starved_experts(blocks) if gptq else {block: [] for block in blocks}
    out: dict[str, str] = {}
    for name in linears:
        parts = split_expert_name(name)
        if parts is not None and parts[1] in starved[parts[0]]:
            out[name] = FALLBACK
    record = {block: {"tokens": [experts[e][0] for e in sorted(experts)],
                      "min_tokens": max(w for _, w in experts.values()),
                      "fallback": starved[block]}
              for block, experts in blocks.items()}
    return out, record


def summary(layers: dict[str, dict]) -> dict | None:
    """The report's ``experts`` entry from every layer's record; None for a dense model."""
    if not layers:
        return None
    total = sum(len(r["tokens"]) for r in layers.values())
    fell = sum(len(r["fallback"]) for r in layers.values())
    return {"hessian": HESSIAN, "fallback_rule": RULE, "router": ROUTER,
            "experts": total, "experts_fallback": fell,
            "fallback_share": round(fell / total, 4) if total else 0.0, "blocks": layers}
