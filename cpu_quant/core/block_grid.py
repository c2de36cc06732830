"""Block grids with a level table and two-level scales, and the result quantized on them.

The 4-bit group grid of ``grid.py`` has 16 evenly spaced levels and one bf16 scale per group.
A *block grid* is the more general shape some on-disk formats store:

* a **level table** ``L`` (any sorted values: ``0..15``, ``-32..31``, or a non-uniform table);
* per block of ``block`` weights a scale ``S`` and, when the grid has mins, an offset ``Z``::

      w = S * L[q] + Z

* the scales come in two levels: a float16 *super scale* ``d`` per super-block of
  ``super_block`` weights times an integer *sub-scale* ``sc`` per block of ``scale_bits`` bits
  (``S = d * sc``; unsigned unless ``signed_scales``); without sub-scales (``scale_bits = 0``)
  ``S = d`` per block. Mins likewise: ``Z = -(dmin * m)`` with an unsigned ``m`` of
  ``scale_bits`` bits and a float16 ``dmin`` per super-block, or ``Z = dmin`` per block without
  sub-scales.

Every product is one float32 multiply of float16-valued and integer operands, in the order
written above, so a result's :meth:`BlockQuant.dequantize` is bit for bit what a consumer that
computes ``(d * sc) * L[q] - (dmin * m)`` in float32 gets (``x - y`` and ``x + (-y)`` are the
same IEEE operation).

A :class:`BlockQuant` is fixed in two steps: its scales and mins (:class:`BlockScales`) before
any code is chosen, then the codes (nearest level, or GPTQ's compensated choice). Pure tensor
math; nothing here knows a file format.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP16_MAX = 65504.0


@dataclass(frozen=True)
class BlockGrid:
    """The shape of a block grid (see the module docstring)."""

    levels: tuple[float, ...]  # sorted ascending
    block: int
    super_block: int  # == block: the scale is stored per block, no sub-scales
    scale_bits: int  # bits of the integer sub-scales and sub-mins; 0 = none
    signed_scales: bool = False
    has_min: bool = False

    def __post_init__(self) -> None:
        if list(self.levels) != sorted(self.levels):
            raise ValueError("levels must be sorted")
        if self.super_block % self.block:
            raise ValueError("the super-block must be whole blocks")
        if (self.scale_bits == 0) != (self.super_block == self.block):
            raise ValueError("sub-scales exist exactly when a super-block holds several blocks")

    @property
    def level_tensor(self) -> torch.Tensor:
        return torch.tensor(self.levels, dtype=torch.float32)

    @property
    def sub_scale_range(self) -> tuple[int, int]:
        """(lowest, highest) integer sub-scale."""
        if self.signed_scales:
            return -(1 << (self.scale_bits - 1)), (1 << (self.scale_bits - 1)) - 1
        return 0, (1 << self.scale_bits) - 1

    @property
    def blocks_per_super(self) -> int:
        return self.super_block // self.block


@dataclass
class BlockScales:
    """The fixed part of a block grid for an [N, K] matrix: what is on disk besides the codes.

    d: float32 (float16-valued) [N, K/super_block]; sc: float32 (integer-valued)
    [N, K/block] or None; dmin, m: the same for the mins, or None.
    """

    grid: BlockGrid
    d: torch.Tensor
    sc: torch.Tensor | None
    dmin: torch.Tensor | None
    m: torch.Tensor | None

    def scales(self) -> torch.Tensor:
        """S per block, float32 [N, K/block]."""
        d = self.d.repeat_interleave(self.grid.blocks_per_super, dim=1)
        return d if self.sc is None else d * self.sc

    def offsets(self) -> torch.Tensor | None:
        """Z per block, float32 [N, K/block], or None for a grid without mins."""
        if self.dmin is None:
            return None
        if self.m is None:
            return self.dmin
        dmin = self.dmin.repeat_interleave(self.grid.blocks_per_super, dim=1)
        return -(dmin * self.m)

    def rows(self, a: int, b: int) -> BlockScales:
        return BlockScales(self.grid, *(None if t is None else t[a:b]
                                        for t in (self.d, self.sc, self.dmin, self.m)))


@dataclass
class BlockQuant:
    """A matrix quantized on a block grid: codes uint8 [N, K] (indices into the level table)
    and its :class:`BlockScales`. ``scales``/``zeros``/``group_size`` read like a
    :class:`~cpu_quant.core.grid.GroupQuant`'s (per-block S and Z, the block)."""

    codes: torch.Tensor
    fixed: BlockScales

    @property
    def grid(self) -> BlockGrid:
        return self.fixed.grid

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def group_size(self) -> int:
        return self.grid.block

    @property
    def scales(self) -> torch.Tensor:
        return self.fixed.scales()

    @property
    def zeros(self) -> torch.Tensor | None:
        return self.fixed.offsets()

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: ``S * L[q] + Z``."""
        n, k = self.codes.shape
        b = self.grid.block
        values = self.grid.level_tensor[self.codes.long()].view(n, k // b, b)
        w = self.fixed.scales().unsqueeze(-1) * values
        z = self.fixed.offsets()
        if z is not None:
            w = w + z.unsqueeze(-1)
        return w.reshape(n, k)

    def rows(self, a: int, b: int) -> BlockQuant:
        return BlockQuant(self.codes[a:b], self.fixed.rows(a, b))

    @staticmethod
    def cat(parts: list[BlockQuant]) -> BlockQuant:
        if len(parts) == 1:
            return parts[0]
        first = parts[0].fixed
        fields = []
        for name in ("d", "sc", "dmin", "m"):
            t = getattr(first, name)
            fields.append(None if t is None else torch.cat([getattr(p.fixed, name) for p in parts]))
        return BlockQuant(torch.cat([p.codes for p in parts]), BlockScales(first.grid, *fields))


def nearest_level(t: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the level nearest to each value of ``t`` (NaN gives the lowest). ``levels``:
    sorted float32 integers (every table here is). Consecutive integers: ``round`` (a value
    halfway takes the even level). Otherwise the midpoints are multiples of 1/2, so the nearest
    level is constant on each interval ``[j/2, (j+1)/2)`` and one lookup on ``floor(2t)``
    finds it (a value on a midpoint takes the upper level)."""
    lo, hi = int(levels[0]), int(levels[-1])
    if hi - lo + 1 == levels.numel():  # consecutive integers: rounding is the lookup
        return (torch.round(t.clamp(lo, hi)).nan_to_num_(lo) - lo).to(torch.uint8)
    table = _midpoint_table(tuple(levels.tolist()))
    j = torch.floor(2 * t.clamp(lo, hi)).nan_to_num_(2 * lo)
    return table[(j - 2 * lo).long().clamp_(0, table.numel() - 1)]


@functools.lru_cache(maxsize=16)
def _midpoint_table(levels: tuple[float, ...]) -> torch.Tensor:
    """Entry ``i``: the index of the level nearest to the centre of ``[lo + i/2, lo + (i+1)/2)``."""
    if any(v != int(v) for v in levels):
        raise ValueError("level tables must hold integers")
    lv = torch.tensor(levels, dtype=torch.float64)
    lo, hi = int(levels[0]), int(levels[-1])
    centres = (torch.arange(2 * lo, 2 * hi + 1, dtype=torch.float64) + 0.5) / 2
    return (centres.unsqueeze(-1) - lv).abs().argmin(-1).to(torch.uint8)


def codes_for(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
              levels: torch.Tensor) -> torch.Tensor:
    """Nearest code per weight for ``w ≈ scale * L[q] + offset`` (both broadcast against
    ``w``). A zero scale gives the level nearest to 0 (the weight is ``offset`` whatever the
    code)."""
    target = w if offset is None else w - offset
    safe = torch.where(scale == 0, torch.full_like(scale, torch.inf), scale)
    return nearest_level(target / safe, levels)


def fp16_exact(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to float16's nearest (saturating at ±65504) and back."""
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(torch.float32)
