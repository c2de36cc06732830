"""The 4-bit group grid shared by every layout, as pure tensor math.

One formula serves both grids: ``w ≈ (q - 8) * scale + zero`` with ``q ∈ [0, 15]``.

* symmetric (GPTQ for vLLM's CPU kernels): ``zero == 0``; vLLM's ``uint4b8`` type and
  ``int4_scaled_mm_cpu`` both hard-wire the 8, so nothing else is representable there;
* asymmetric (tinygemm ``cpu_int4``): ``zero`` is a free per-group value.

Scales may be negative: the search can map a group's signed extreme onto the ``-8`` level,
which the ``[-8, 7]`` code range otherwise wastes (the llama.cpp ``Q4_0`` trick). Every consumer
computes ``(q - 8) * scale`` without assuming a sign.

Scales are stored as bf16, so the math here always works with bf16-representable scale values
(``round_scale``): codes are chosen for the scale that will be on disk, not a float32 one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMIN, QMAX, QZERO = 0, 15, 8


def round_scale(scale: torch.Tensor) -> torch.Tensor:
    """Round to the stored dtype (bf16) and back to float32."""
    return scale.to(torch.bfloat16).to(torch.float32)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest code for ``w`` under ``(q - 8) * scale + zero``; ``scale`` broadcasts against ``w``.

    A zero scale (an all-zero group) gives code 8.
    """
    target = w if zero is None else w - zero
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(target / safe) + QZERO
    q = torch.where(scale == 0, torch.full_like(q, QZERO), q)
    return q.clamp_(QMIN, QMAX)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    w = (q.to(torch.float32) - QZERO) * scale
    return w if zero is None else w + zero


@dataclass
class GroupQuant:
    """A quantized matrix, independent of any on-disk layout.

    codes: uint8 [N, K], values 0..15. scales: float32 [N, K/g] (bf16-representable).
    zeros: float32 [N, K/g] or None for the symmetric grid. group_size: g (K for one group
    per row, which vLLM spells -1).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.group_size
        q = self.codes.view(n, k // g, g)
        scale = self.scales.unsqueeze(-1)
        zero = None if self.zeros is None else self.zeros.unsqueeze(-1)
        return dequantize_codes(q, scale, zero).reshape(n, k)


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """View [N, K] as [N, K/g, g]."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide in-features {k}")
    return w.reshape(n, k // group_size, group_size)
