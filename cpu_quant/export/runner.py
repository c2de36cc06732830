"""The host side of the static-KV-cache graph: masks, positions, cache writes, greedy decoding.

One ``StaticKVRunner`` drives any pair of step functions with the I/O contract of
``model.StaticCausalLM`` — an eager module, a quantized ``GraphModule``, or the ``prefill`` and
``decode`` methods of a loaded ``.pte`` — so every arm compared in verification goes through
exactly the same host loop, and a difference can only come from the graph itself.

The cache lives here, as float32 ``[L, H_kv, C, D]`` tensors. A call at start position ``p``
with ``n`` valid rows (``n <= T``, the rest padding) attends to slots ``0..p-1`` and causally to
its own rows; afterwards rows ``0..n-1`` of ``k_new``/``v_new`` are written into slots
``p..p+n-1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import CpuQuantError
from .model import MASK_VALUE

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


class StaticKVRunner:
    """Greedy generation and teacher-forced scoring through a prefill and a decode step."""

    def __init__(self, shape: GraphShape, prefill: StepFn, decode: StepFn) -> None:
        self.shape = shape
        self.prefill_fn = prefill
        self.decode_fn = decode
        self.reset()

    def reset(self) -> None:
        self.k_cache, self.v_cache = self.shape.empty_cache()
        self.pos = 0

    def _call(self, fn: StepFn, t: int, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        if self.pos + n > self.shape.max_seq_len:
            raise CpuQuantError(f"sequence of {self.pos + n} tokens exceeds the exported "
                                f"max_seq_len {self.shape.max_seq_len}")
        inputs = step_inputs(self.shape, tokens, self.pos, t, self.k_cache, self.v_cache)
        logits, k_new, v_new = fn(*inputs)[:3]
        self.k_cache[:, :, self.pos:self.pos + n] = k_new[:, :, :n]
        self.v_cache[:, :, self.pos:self.pos + n] = v_new[:, :, :n]
        self.pos += n
        return logits[0, :n].to(torch.float32)

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Logits [n, V] for ``tokens``, fed in prefill-sized chunks (the last one padded)."""
        t = self.shape.prefill_len
        chunks = [self._call(self.prefill_fn, t, tokens[i:i + t]) for i in range(0, len(tokens), t)]
        return torch.cat(chunks)

    def decode(self, token: int) -> torch.Tensor:
        """Logits [V] after one more token, through the single-token method."""
        return self._call(self.decode_fn, 1, [token])[0]

    def generate(self, prompt: list[int], max_new_tokens: int,
                 eos_token_id: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation of ``prompt``: new tokens and the logits each was chosen from."""
        self.reset()
        logits = self.prefill(prompt)[-1]
        new_tokens: list[int] = []
        step_logits: list[torch.Tensor] = []
        while len(new_tokens) < max_new_tokens:
            step_logits.append(logits)
            token = int(torch.argmax(logits))
            new_tokens.append(token)
            if token == eos_token_id or self.pos >= self.shape.max_seq_len:
                break
            logits = self.decode(token)
        return new_tokens, step_logits

    def score(self, tokens: list[int]) -> torch.Tensor:
        """Teacher-forced logits [n, V] for a fresh sequence, through the prefill method."""
        self.reset()
        return self.prefill(tokens)
