"""The static-KV-cache graph's calling convention, shared by the model that is exported
(``model.StaticCausalLM``) and the host loop that drives it (``runner.StaticKVRunner``): the
static shapes of one exported model and the inputs of one call.

``MASK_VALUE`` is -255 rather than -inf: with 16-bit activations the mask is a quantized tensor,
and -inf would destroy its scale; exp(-255) is 0 in float32 anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..core.errors import CpuQuantError

MASK_VALUE = -255.0
StepFn = Callable[..., Sequence[torch.Tensor]]


@dataclass(frozen=True)
class GraphShape:
    """Static shapes of one exported model (its methods share all but ``T``)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    prefill_len: int

    def methods(self) -> dict[str, int]:
        """Method name -> rows per call: ``prefill`` and ``decode``, or ``decode`` alone when
        ``prefill_len`` is 1 (the two graphs would be the same; a prompt is then fed a token at
        a time, as ExecuTorch's runner does for a static-shape model without a prefill method)."""
        if self.prefill_len == 1:
            return {"decode": 1}
        return {"prefill": self.prefill_len, "decode": 1}

    def step_pair(self, fns: Mapping[str, StepFn]) -> tuple[StepFn, StepFn]:
        """(prefill, decode) from a program's methods by name: ``decode`` serves as the prefill
        step of a single-method program."""
        missing = set(self.methods()) - set(fns)
        if missing:
            raise CpuQuantError(f"the program lacks its {', '.join(sorted(missing))} method")
        return fns.get("prefill", fns["decode"]), fns["decode"]

    def example_inputs(self, t: int) -> tuple[torch.Tensor, ...]:
        """Valid inputs for a call with ``t`` rows at position 0 (what export traces with)."""
        return step_inputs(self, list(range(1, t + 1)), 0, t, *self.empty_cache())

    def empty_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.n_layers, self.n_kv_heads, self.max_seq_len, self.head_dim)
        return torch.zeros(shape), torch.zeros(shape)


def step_inputs(shape: GraphShape, tokens: list[int], start: int, t: int,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs for one call: ``tokens`` (``n <= t`` of them) at positions ``start..``."""
    n, c = len(tokens), shape.max_seq_len
    ids = torch.zeros(1, t, dtype=torch.long)
    ids[0, :n] = torch.tensor(tokens, dtype=torch.long)
    # Padding rows get clamped positions: their outputs are discarded, the index must be valid.
    pos = torch.clamp(torch.arange(start, start + t, dtype=torch.long), max=c - 1)
    mask = torch.full((1, 1, t, c + t), MASK_VALUE)
    mask[..., :start] = 0.0
    rows = torch.arange(t).unsqueeze(1)
    cols = torch.arange(t).unsqueeze(0)
    mask[0, 0, :, c:] = torch.where((cols <= rows) & (cols < n), 0.0, MASK_VALUE)
    return ids, pos, mask, k_cache, v_cache
