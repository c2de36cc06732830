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

import torch

from ..core.errors import CpuQuantError
from .graph import GraphShape, StepFn, step_inputs


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
