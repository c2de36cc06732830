"""Which quantization grid an unquantized checkpoint's weights already sit on.

Every model the package registries ship here was stored as a GGUF quantization and
dequantized to bf16 (the demo model from Q4_1, others from Q4_K_M). Such weights sit exactly
on that grid, so a 4-bit method that uses the same grid recovers them almost exactly and looks
near-lossless: fidelity must be judged on a model whose source grid differs from the method's.
This module detects the grid from the weights alone, on a sample of rows of each linear:

* **levels per block of 32** along the input dimension (GGUF's block): a trained bf16 weight
  has 32 distinct values in most blocks of 32; a dequantized 4-bit file has at most 16 in
  every block, a 5-bit one at most 32 and hardly ever 32. A grid of 6 bits or more (Q6_K,
  Q8_0) has up to 32 too: this count cannot tell it from trained weights;
* **uniform**: whether each block's values are ``m + s·q`` for integers ``q`` in ``[0, 15]``
  (Q4_0, Q4_1 and the K-quants' sub-blocks are; IQ4_NL's fixed non-uniform levels are not), to
  within the bf16 rounding of the stored values; **symmetric** when ``m = -8 s`` (Q4_0: every
  value an integer multiple of its step);
* **6-bit sub-scales**: whether, in each super-block of 256 (Q4_K's), the eight blocks' steps
  are ``d · sc`` with integer ``sc`` in ``[1, 63]`` where the largest is 63, as llama.cpp's
  Q4_K quantizer stores them.

The verdict per linear is the most specific class that nearly every sampled block fits
(:data:`MOST`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

BLOCK = 32  # GGUF's block of the 4-bit types
SUPER = 256  # the K-quants' super-block
SAMPLE_ROWS = 64  # rows read per linear (evenly spaced)
# bf16 keeps 8 significant bits: a value is within 2^-8 of its magnitude of the exact one
BF16_REL = 2.0 ** -8
# A block whose step is below bf16's rounding of its values (a tiny sub-scale under a large
# min) cannot show its grid: a class needs this share of the blocks (super-blocks) to fit.
# Random steps fit the 6-bit sub-scale test by chance in about 1 % of super-blocks.
MOST = 0.99
MOST_SUPER = 0.9

GRIDS = ("4-bit (Q4_0-like, symmetric)", "4-bit (Q4_K-like, 6-bit sub-scales)",
         "4-bit (Q4_1-like, affine)", "4-bit (non-uniform, IQ4_NL-like)", "5-bit",
         "no grid of 5 bits or fewer")


@dataclass
class LinearGrid:
    name: str
    rows_sampled: int
    max_levels: int  # the most distinct values in one block of 32
    grid: str  # one of GRIDS


@dataclass
class SourceGrid:
    linears: list[LinearGrid] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return dict(Counter(lin.grid for lin in self.linears))

    def summary(self) -> str:
        """One line: how many linears sit on which grid, most first."""
        if not self.linears:
            return "no 2-D linear weights to read"
        total = len(self.linears)
        parts = [f"{grid} in {n} of {total} linears" for grid, n in
                 sorted(self.counts().items(), key=lambda kv: -kv[1])]
        return "; ".join(parts)

    @property
    def on_a_grid(self) -> bool:
        """Whether most linears already sit on a quantization grid."""
        return sum(lin.grid != GRIDS[-1] for lin in self.linears) * 2 > len(self.linears)

    def to_json(self) -> dict:
        return {"summary": self.summary(), "counts": self.counts(),
                "sample_rows": SAMPLE_ROWS, "block": BLOCK}


def sample_rows(n: int, rows: int = SAMPLE_ROWS) -> torch.Tensor:
    """Evenly spaced row indices (all rows when there are fewer)."""
    return torch.arange(n) if n <= rows else torch.linspace(0, n - 1, rows).round().long()


def _levels(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted values of each block [.., 32] and the number of distinct ones."""
    v = blocks.sort(-1).values
    distinct = 1 + (v[..., 1:] != v[..., :-1]).sum(-1)
    return v, distinct


def _uniform_steps(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For sorted blocks ``v`` [B, 32] whose values may be ``m + s·q`` (q in 0..15): the
    refitted step ``s``, the codes ``q`` relative to the block's minimum, and whether every
    value fits (to bf16's rounding of it)."""
    v = v.double()
    lo = v[:, :1]
    gaps = v[:, 1:] - v[:, :-1]
    tol = BF16_REL * v.abs().amax(-1, keepdim=True)
    # the smallest gap clearly above rounding noise is one step (or a small multiple of it);
    # the gaps near it average out the rounding of each value
    real = gaps > 2 * tol
    gmin = torch.where(real, gaps, torch.full_like(gaps, float("inf"))).amin(-1, keepdim=True)
    flat = ~torch.isfinite(gmin)  # a block of one value (all zeros, say): any grid holds it
    gmin = torch.where(flat, torch.ones_like(gmin), gmin)
    near = real & (gaps <= 1.5 * gmin)
    step = (gaps * near).sum(-1, keepdim=True) / near.sum(-1, keepdim=True).clamp_min(1)
    step = torch.where(flat, gmin, step)
    for _ in range(2):  # codes for the step, then the least-squares step through the codes
        q = ((v - lo) / step).round()
        den = (q * q).sum(-1, keepdim=True)
        step = torch.where(den > 0, ((v - lo) * q).sum(-1, keepdim=True) / den.clamp_min(1e-300),
                           step)
    q = ((v - lo) / step).round()
    fits = ((lo + q * step - v).abs() <= 2 * tol + 1e-30).all(-1) & (q.amax(-1) <= 15)
    return step.squeeze(-1), q, fits | flat.squeeze(-1)


def _symmetric(v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Whether each block's values are integer multiples of its step, 16 codes around 0."""
    v = v.double()
    s = step.unsqueeze(-1)
    a = (v / s).round()
    tol = BF16_REL * v.abs().amax(-1, keepdim=True)
    lo, hi = a.amin(-1), a.amax(-1)
    # Q4_0's scale is signed (its extreme lands on -8), so the codes span -8..7 or -7..8
    span = ((lo >= -8) & (hi <= 7)) | ((lo >= -7) & (hi <= 8))
    return ((a * s - v).abs() <= 2 * tol + 1e-30).all(-1) & span


def _six_bit_sub_scales(step: torch.Tensor) -> torch.Tensor:
    """Per super-block (rows of 8 block steps): whether every step is ``d · sc`` with integer
    ``sc`` in 1..63 and the largest step's ``sc`` 63 (llama.cpp's Q4_K)."""
    smax = step.amax(-1, keepdim=True)
    sc = 63 * step / smax
    # each step carries bf16's rounding of its block's values: allow that much of a step
    return ((sc - sc.round()).abs() <= 0.25).all(-1) & (sc.round().amin(-1) >= 1)


def classify(weight: torch.Tensor) -> tuple[int, str]:
    """(the most distinct values in one block of 32, the grid) of a 2-D weight's rows."""
    n, k = weight.shape
    if k % BLOCK or not weight.numel():
        return 0, GRIDS[-1]
    w = weight.float().reshape(-1, BLOCK)
    v, distinct = _levels(w)
    most = int(distinct.max())
    if most >= BLOCK:  # trained weights, or a grid of 6 bits or more
        return most, GRIDS[-1]
    if most > 16:
        return most, GRIDS[4]
    step, _, fits = _uniform_steps(v)
    if float(fits.double().mean()) < MOST:
        return most, GRIDS[3]
    if float(_symmetric(v, step).double().mean()) >= MOST:
        return most, GRIDS[0]
    if k % SUPER == 0 and float(_six_bit_sub_scales(step.reshape(-1, SUPER // BLOCK))
                                .double().mean()) >= MOST_SUPER:
        return most, GRIDS[1]
    return most, GRIDS[2]


def detect(named_weights) -> SourceGrid:
    """The grid of each ``(name, weight)``: a lazy iterable of 2-D linear weights (their sampled
    rows suffice: :func:`sample_rows`)."""
    out = SourceGrid()
    for name, w in named_weights:
        most, grid = classify(w)
        out.linears.append(LinearGrid(name, int(w.shape[0]), most, grid))
    return out


FLOAT_DTYPES = ("BF16", "F16", "F32")


def is_linear_weight(name: str, shape: tuple[int, ...], dtype: str) -> bool:
    """A float 2-D ``.weight`` that is not an input embedding: a linear or the head."""
    module, _, leaf = name.rpartition(".")
    return (leaf == "weight" and len(shape) == 2 and dtype in FLOAT_DTYPES
            and "embed" not in module and not module.endswith("wte"))


def checkpoint_grid(ckpt) -> SourceGrid:
    """The grid of every linear (and an untied head) of an open checkpoint
    (``core.io.checkpoint.Checkpoint``), from sampled rows."""
    names = [n for n in ckpt.names if is_linear_weight(n, ckpt.shape(n), ckpt.dtype(n))]
    return detect((n, ckpt.rows(n, sample_rows(ckpt.shape(n)[0]))) for n in names)
