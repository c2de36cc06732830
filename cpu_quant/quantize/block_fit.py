"""Fitting a block grid (``core/block_grid.py``) to a weight, and quantizing on it: the weighted
scale search, round-to-nearest, and GPTQ on the fixed grid. Pure tensor math.

Objective, as in ``scale_search.py``: per block, ``E = Σ_i d_i (w_i - ŵ_i)²`` with ``d`` the
Hessian diagonal of the input channels (uniform without calibration).

The grid is fixed before any code is chosen, from the original weights (GPTQ's "static
groups"), and every candidate is scored with the values that will be on disk:

1. **Per block, a float scale (and min).** Without mins: the block's signed extreme mapped onto
   either end of the level table, or from one level inside it to three beyond it (clipped),
   in half levels, each candidate's nearest codes refitted by weighted least squares
   (``s = Σdwl / Σdl²``), the best kept. With mins (levels ``0..n``): the range
   ``[min(w), max(w)]`` (its low end clamped at 0 when the min is stored as a non-negative
   integer) over the top level, from one level less to three more, each candidate refitted
   jointly (``s``, ``z``). A grid without sub-scales scores its candidates with the scale and
   min rounded to float16, as stored.
2. **Sub-scales** (grids with super-blocks): the super scale ``d`` from the largest block scale
   and the sub-scale range, rounded to float16, then a few candidates around it; for each,
   every block's integer sub-scale (and sub-min) is chosen among the neighbours of its
   rounded value by the block's true weighted error with nearest codes; the candidate of least
   super-block error wins. So the stored grid is the least-error one of a search that contains
   the plain rounding (llama.cpp's ``make_qkx2_quants`` / ``make_qx_quants`` style: scale
   candidates, least-squares refits, then the 6- or 8-bit sub-scales).

Then codes: the nearest level (:func:`quantize_block_rtn`), or GPTQ
(:func:`quantize_block_gptq`): the column sweep of ``gptq.py`` with each column rounded to the
nearest level of its block's fixed ``(S, Z)`` and the rounding error compensated on the columns
not yet swept.
"""

from __future__ import annotations

import torch

from ..core.block_grid import (
    BlockGrid,
    BlockQuant,
    BlockScales,
    codes_for,
    fp16_exact,
    nearest_level,
)
from .gptq import GPTQStats, HessianPrep, prepare_hessian

# A block's scale candidates put its extreme (or its range's top) on the end level, or from one
# level inside it to three beyond it (clipped), in half levels, each candidate then refitted once
# by weighted least squares; llama.cpp's make_qx_quants / make_qkx2_quants try ±0.9 / ±1 level
# in steps of 0.1 and refit each. Measured on random layers with outliers and a skewed
# importance, reaching three levels out lowered the weighted error on every type
# (tests/test_block_fit.py's layer: IQ4_NL 0.72 -> 0.68 of plain rounding, Q5_0 0.84 -> 0.80)
LEVEL_STEPS = tuple(0.5 * i for i in range(-2, 7))  # -1 .. +3 levels
SUPER_FACTORS = (0.94, 0.97, 1.0, 1.03)  # super-scale candidates around the plain one
ROWS_CHUNK = 1 << 16  # weights per fitting call (the candidates hold a few copies)


def _err(wb: torch.Tensor, d: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
         levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted error per block [..., 1], nearest codes) for scale ``s`` and offset ``z``."""
    q = codes_for(wb, s, z, levels)
    deq = s * levels[q.long()]
    if z is not None:
        deq = deq + z
    e = wb - deq
    return (d * e * e).sum(-1, keepdim=True), q


class _Best:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.e = torch.full(shape, torch.inf)
        self.s = torch.zeros(shape)
        self.z = torch.zeros(shape)

    def keep(self, e: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> None:
        better = e < self.e
        self.e = torch.where(better, e, self.e)
        self.s = torch.where(better, s, self.s)
        if z is not None:
            self.z = torch.where(better, z, self.z)


def _fit_no_min(wb: torch.Tensor, d: torch.Tensor, levels: torch.Tensor, stored) -> torch.Tensor:
    """Per-block scale [..., 1] for ``w ≈ s·L[q]``; ``stored`` rounds a scale as it is kept."""
    best = _Best(wb.shape[:-1] + (1,))
    extreme = torch.gather(wb, -1, wb.abs().argmax(-1, keepdim=True))
    # each end level, and the gap to its neighbour: a step of one level there
    ends = [(float(levels[0]), float(levels[0] - levels[1])),
            (float(levels[-1]), float(levels[-1] - levels[-2]))]
    # For fixed codes the error is a quadratic in s, E(s) = Σdw² - 2sΣdwl + s²Σdl², exact at
    # the candidate (its codes are the nearest) and an upper bound at the refit (re-rounding
    # can only do better): one pass over the weights per candidate.
    sw2 = (d * wb * wb).sum(-1, keepdim=True)
    for end, gap in ends:
        if end == 0:
            continue
        for step in LEVEL_STEPS:
            s = stored(extreme / (end + step * gap))
            lq = levels[codes_for(wb, s, None, levels).long()]
            swl = (d * wb * lq).sum(-1, keepdim=True)
            sll = (d * lq * lq).sum(-1, keepdim=True)
            best.keep(sw2 - 2 * s * swl + s * s * sll, s, None)
            s = stored(torch.where(sll > 0, swl / sll.clamp_min(1e-30), s))
            best.keep(sw2 - 2 * s * swl + s * s * sll, s, None)
    zero = wb.abs().amax(-1, keepdim=True) == 0
    return torch.where(zero, torch.zeros_like(best.s), best.s)


def _fit_with_min(wb: torch.Tensor, d: torch.Tensor, levels: torch.Tensor, stored,
                  nonpositive_min: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block (scale, offset) [..., 1] for ``w ≈ s·L[q] + z`` with levels ``0..n``."""
    top = float(levels[-1])
    best = _Best(wb.shape[:-1] + (1,))
    lo = wb.amin(-1, keepdim=True)
    hi = wb.amax(-1, keepdim=True)
    if nonpositive_min:
        lo = lo.clamp_max(0.0)
    sd = d.sum(-1, keepdim=True)
    sdw = (d * wb).sum(-1, keepdim=True)

    def clamp(s, z):
        if nonpositive_min:
            z = z.clamp_max(0.0)
        return stored(s.clamp_min(0.0)), stored(z)

    sw2 = (d * wb * wb).sum(-1, keepdim=True)

    def quadratic(s, z, swl, sll, sl):
        # E(s, z) for fixed codes (see _fit_no_min): exact at the candidate, a bound at the refit
        return sw2 - 2 * s * swl - 2 * z * sdw + s * s * sll + 2 * s * z * sl + z * z * sd

    for step in LEVEL_STEPS:
        s, z = clamp((hi - lo) / (top + step), lo)
        lq = levels[codes_for(wb, s, z, levels).long()]
        sl = (d * lq).sum(-1, keepdim=True)
        sll = (d * lq * lq).sum(-1, keepdim=True)
        swl = (d * wb * lq).sum(-1, keepdim=True)
        best.keep(quadratic(s, z, swl, sll, sl), s, z)
        det = sd * sll - sl * sl
        ok = det.abs() > 1e-20 * (sd * sll).abs().clamp_min(1e-30)
        safe = torch.where(ok, det, torch.ones_like(det))
        s, z = clamp(torch.where(ok, (sd * swl - sl * sdw) / safe, s),
                     torch.where(ok, (sll * sdw - sl * swl) / safe, z))
        best.keep(quadratic(s, z, swl, sll, sl), s, z)
    return best.s, best.z


def _neighbours(x: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
    r = torch.round(x)
    return [torch.clamp(r + k, lo, hi) for k in (-1, 0, 1)]


def _safe_ratio(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(x), x / torch.where(d == 0, torch.ones_like(d), d))


def _sub_scales(wb, d, levels, grid: BlockGrid, s, z):
    """Quantize per-block float (s, z) [R, nb, 1] to float16 super scales and integer
    sub-scales, searching the super scale; returns (d, sc, dmin, m), each [R, nsup, bps]-shaped
    views flattened by the caller."""
    r, nb, b = wb.shape
    bps = grid.blocks_per_super
    shape = (r, nb // bps, bps, b)
    w4, d4 = wb.reshape(shape), d.reshape(shape)
    s3, z3 = s.reshape(shape[:3]), z.reshape(shape[:3])
    lo, hi = grid.sub_scale_range
    if grid.signed_scales:
        ext = torch.gather(s3, -1, s3.abs().argmax(-1, keepdim=True))
        d0 = ext / lo  # the signed extreme lands on the lowest sub-scale, as llama.cpp's Q6_K
    else:
        d0 = s3.amax(-1, keepdim=True) / hi
    if grid.has_min:
        dmin = fp16_exact((-z3).amax(-1, keepdim=True) / hi)
        m_cands = _neighbours(_safe_ratio(-z3, dmin), 0, hi)
    else:
        dmin, m_cands = None, [None]
    best_e = torch.full(shape[:2] + (1,), torch.inf)
    best_d = torch.zeros(shape[:2] + (1,))
    best_sc = torch.zeros(shape[:3])
    best_m = torch.zeros(shape[:3])
    for f in SUPER_FACTORS:
        dd = fp16_exact(d0 * f)
        blk_e = torch.full(shape[:3], torch.inf)
        blk_sc = torch.round(_safe_ratio(s3, dd)).clamp(lo, hi)
        blk_m = m_cands[1] if grid.has_min else None
        # the sub-scale among its neighbours with the rounded sub-min, then the sub-min
        for sc in _neighbours(_safe_ratio(s3, dd), lo, hi):
            e = _sub_error(w4, d4, levels, dd, sc, dmin, blk_m)
            better = e < blk_e
            blk_e, blk_sc = torch.where(better, e, blk_e), torch.where(better, sc, blk_sc)
        if grid.has_min:
            for m in (m_cands[0], m_cands[2]):
                e = _sub_error(w4, d4, levels, dd, blk_sc, dmin, m)
                better = e < blk_e
                blk_e, blk_m = torch.where(better, e, blk_e), torch.where(better, m, blk_m)
        else:
            blk_m = best_m
        tot = blk_e.sum(-1, keepdim=True)
        better = tot < best_e
        best_e = torch.where(better, tot, best_e)
        best_d = torch.where(better, dd, best_d)
        best_sc = torch.where(better, blk_sc, best_sc)
        best_m = torch.where(better, blk_m, best_m)
    return best_d, best_sc, dmin, best_m


def _sub_error(w4, d4, levels, dd, sc, dmin, m) -> torch.Tensor:
    scale = (dd * sc).unsqueeze(-1)
    off = None if m is None else (-(dmin * m)).unsqueeze(-1)
    return _err(w4, d4, scale, off, levels)[0].squeeze(-1)


def fit_block_scales(weight: torch.Tensor, importance: torch.Tensor | None, grid: BlockGrid
                     ) -> BlockScales:
    """The grid's scales and mins for ``weight`` [N, K] (K a multiple of the super-block),
    weighted by ``importance`` [K] (the Hessian diagonal; None: uniform). Row-wise: any row
    chunking gives the same result."""
    w = weight.to(torch.float32)
    n, k = w.shape
    if k % grid.super_block:
        raise ValueError(f"in-features {k} are not whole super-blocks of {grid.super_block}")
    imp = torch.ones(k) if importance is None else importance.to(torch.float32)
    rows = max(1, ROWS_CHUNK // k)
    parts = [_fit_rows(w[r0:r0 + rows], imp, grid) for r0 in range(0, n, rows)]
    fields = [None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(4)]
    return BlockScales(grid, *fields)


def _fit_rows(w: torch.Tensor, imp: torch.Tensor, grid: BlockGrid):
    r, k = w.shape
    b = grid.block
    wb = w.reshape(r, k // b, b)
    # a floor keeps the refits defined on channels that never fire (as scale_search._weights)
    d = (imp + 1e-12 * imp.mean().clamp_min(1e-30)).reshape(1, k // b, b).expand_as(wb)
    levels = grid.level_tensor
    direct = grid.scale_bits == 0
    stored = fp16_exact if direct else (lambda x: x)
    if grid.has_min:
        s, z = _fit_with_min(wb, d, levels, stored, nonpositive_min=not direct)
    else:
        s, z = _fit_no_min(wb, d, levels, stored), None
    if direct:
        return s.squeeze(-1), None, None if z is None else z.squeeze(-1), None
    if z is None:
        z = torch.zeros_like(s)
    dd, sc, dmin, m = _sub_scales(wb, d, levels, grid, s, z)
    return (dd.squeeze(-1), sc.reshape(r, -1), None if dmin is None else dmin.squeeze(-1),
            None if dmin is None else m.reshape(r, -1))


def quantize_block_rtn(weight: torch.Tensor, grid: BlockGrid,
                       importance: torch.Tensor | None = None) -> BlockQuant:
    """The fitted grid and each weight's nearest level."""
    fixed = fit_block_scales(weight, importance, grid)
    return BlockQuant(nearest_codes(weight.to(torch.float32), fixed), fixed)


def nearest_codes(w: torch.Tensor, fixed: BlockScales) -> torch.Tensor:
    n, k = w.shape
    b = fixed.grid.block
    z = fixed.offsets()
    q = codes_for(w.reshape(n, k // b, b), fixed.scales().unsqueeze(-1),
                  None if z is None else z.unsqueeze(-1), fixed.grid.level_tensor)
    return q.reshape(n, k)


def quantize_block_gptq(weight: torch.Tensor, hessian: torch.Tensor | HessianPrep,
                        grid: BlockGrid, *, act_order: bool = True, damp: float = 0.01,
                        block_size: int = 128) -> tuple[BlockQuant, GPTQStats]:
    """GPTQ on a block grid fixed beforehand from the original weights (importance: the
    Hessian diagonal). weight [N, K]; hessian [K, K] or its :func:`prepare_hessian` made with
    the same ``act_order`` and ``damp``."""
    prep = hessian if isinstance(hessian, HessianPrep) else prepare_hessian(
        hessian, act_order=act_order, damp=damp)
    w = weight.to(torch.float32).clone()
    n, k = w.shape
    w[:, prep.dead] = 0.0
    fixed = fit_block_scales(w, prep.importance, grid)
    levels = grid.level_tensor
    b = grid.block
    scales = fixed.scales()  # [N, K/b]
    zeros = fixed.offsets()
    safe = scales.masked_fill(scales == 0, torch.inf)
    perm, hinv = prep.perm, prep.hinv
    w = w[:, perm]
    blocks = (perm // b).tolist()
    pivots = torch.diagonal(hinv).tolist()
    codes_t = torch.empty(k, n, dtype=torch.uint8)
    # the block held transposed (a column is a contiguous row), as gptq.quantize_gptq
    s_t, safe_t = scales.t().contiguous(), safe.t().contiguous()
    z_t = None if zeros is None else zeros.t().contiguous()
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].t().contiguous()
        err1 = torch.empty_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            blk = blocks[col]
            wcol = w1[i]
            target = wcol if z_t is None else wcol - z_t[blk]
            q = nearest_level(target / safe_t[blk], levels).long()
            codes_t[col] = q
            deq = s_t[blk] * levels[q]
            if z_t is not None:
                deq = deq + z_t[blk]
            e = torch.sub(wcol, deq, out=err1[i]).div_(pivots[col])
            w1[i + 1:].addr_(hinv1[i, i + 1:], e, alpha=-1.0)
        w[:, i2:] -= err1.t() @ hinv[i1:i2, i2:]
    codes = codes_t.t()[:, torch.argsort(perm)].contiguous()
    return BlockQuant(codes, fixed), GPTQStats(prep.damp, prep.damp_raised, prep.fallback)
