"""The names every layer agrees on: which modules vLLM fuses, the output head's name, and how a
``dynamic`` rule set (GPTQModel's and vLLM's per-module overrides in ``quantization_config``)
gives one module its group."""

from __future__ import annotations

import re

# vLLM fuses these HF projections into one module; its `dynamic` regexes see the fused name.
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
HEAD_NAME = "lm_head"
DOWN_LEAF = "mlp.down_proj"


def group_for_module(dynamic: dict[str, dict], name: str, default_group: int) -> int | None:
    """The group a consumer applying ``dynamic`` (first match wins) gives ``name``; None = skip."""
    for pattern, override in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return None
        elif re.match(pattern.removeprefix("+:"), name):
            return int(override.get("group_size", default_group))
    return default_group
