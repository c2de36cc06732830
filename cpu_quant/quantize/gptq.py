"""GPTQ (Frantar et al. 2022) and round-to-nearest on the 4-bit group grid, as pure tensor math.

Inputs are a float weight ``W`` [N, K] and, for GPTQ, the Hessian ``H = 2 XᵀX / n`` [K, K]
accumulated in float32 over the calibration tokens. Outputs are a :class:`GroupQuant`.

* dampening: ``damp · mean(diag H)`` is added to the diagonal (default 1%); when the Cholesky
  factorisation fails the factor is raised (×3 each time, up to 100×) and the used value is
  reported. A Hessian of few calibration tokens (fewer than its columns: a rarely routed
  expert, a wide down projection) is singular, and float32's rounding can then defeat every
  float32 step: the same and larger steps follow in float64 (``DAMP_STEPS_FLOAT64``), and
  when even those fail :class:`HessianNotPositiveDefinite` tells the caller to fall back to
  round-to-nearest with the weighted scale search (``schedule.quantize_linears`` does, and
  reports it). A Hessian that factors in float32 is used as it is;
* the factorisation (``factor.py``) has the same bits at any thread count;
* dead input channels (a zero diagonal: the channel never fired) get ``H[i, i] = 1`` and
  their weight columns are zeroed, as in the reference GPTQ implementation;
* the column sweep is blocked with lazy batch updates; the block is a multiple of the group
  size so that a group never straddles two blocks and its scale search sees the fully updated
  columns;
* groups: with act-order (columns swept by decreasing Hessian diagonal; the CLI's default), the
  scales are searched on the original weights before the sweep ("static groups"), so the column
  order changes nothing in the saved layout and ``g_idx`` stays ``k // g`` (vLLM rejects
  ``desc_act``); GPTQModel's default ``act_group_aware`` ordering keeps its layout plain the
  same way. Without act-order, each group's scale is searched when the sweep reaches it, on the
  error-compensated weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.grid import QMAX, QMIN, QZERO, GroupQuant, grouped, quantize_codes
from .factor import cholesky_lower, invert_lower
from .scale_search import absmax_scales, search_asymmetric_scales, search_symmetric_scales

DAMP_STEPS = (1.0, 3.0, 10.0, 30.0, 100.0)
# after every float32 step failed: float64, from the requested damping up to 1000x it (10x
# the mean diagonal at the default 1%: the damping then outweighs the Hessian and GPTQ has
# little left to correct; past it, round-to-nearest is the honest answer)
DAMP_STEPS_FLOAT64 = (1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
SEARCH_CHUNK = 1 << 18  # weights per static-group scale search call (1 MiB of float32)


@dataclass(frozen=True)
class GridSpec:
    """What grid to fit: symmetric (zero 0) or asymmetric; searched scales or plain absmax;
    with ``positive_scales``, symmetric scales are never negative (the phone runtimes store
    positive block scales only; ``scale_search.search_symmetric_scales``)."""

    symmetric: bool = True
    scale_search: bool = True
    positive_scales: bool = False


class HessianNotPositiveDefinite(ValueError):
    """No damping step makes the Hessian factor: GPTQ cannot run on it."""


@dataclass
class GPTQStats:
    damp: float | None  # None: no damping made the Hessian factor (fallback "rtn")
    damp_raised: bool
    # None: factored in float32 as asked; "float64": float32 failed at every damping step;
    # "rtn": float64 did too, and the weight took round-to-nearest (schedule.quantize_linears)
    fallback: str | None = None


def fit_group(w: torch.Tensor, importance: torch.Tensor | None, grid: GridSpec
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero) per group for w [..., g]; returns tensors of shape [..., 1]."""
    if grid.symmetric:
        if grid.scale_search:
            return search_symmetric_scales(w, importance, grid.positive_scales), None
        return absmax_scales(w), None
    if grid.scale_search:
        return search_asymmetric_scales(w, importance)
    from .scale_search import minmax_scales_zeros

    return minmax_scales_zeros(w)


def quantize_rtn(weight: torch.Tensor, group_size: int, grid: GridSpec,
                 importance: torch.Tensor | None = None) -> GroupQuant:
    """Round-to-nearest with (optionally) the weighted scale search. importance: [K] or None."""
    w = weight.to(torch.float32)
    n, k = w.shape
    g = k if group_size == -1 else group_size
    wg = grouped(w, g)
    imp = None if importance is None else grouped(importance.reshape(1, k).to(torch.float32), g)
    scale, zero = fit_group(wg, imp, grid)
    codes = quantize_codes(wg, scale, zero).to(torch.uint8).reshape(n, k)
    return GroupQuant(codes, scale.squeeze(-1), None if zero is None else zero.squeeze(-1), g)


def _damped_cholesky(reversed_h: torch.Tensor, damp: float, steps: tuple[float, ...] = DAMP_STEPS
                     ) -> tuple[torch.Tensor, float, bool]:
    """M, the lower Cholesky factor of ``J(H + λI)J``, with ``λ`` = ``damp`` times the mean
    diagonal, ``damp`` raised through ``steps`` until H + λI factors (in the matrix's dtype);
    :class:`HessianNotPositiveDefinite` when none does. ``reversed_h`` is ``JHJ``: H with its
    rows and columns in reverse order (J the order reversal). Returns (M, the damping used,
    whether it was raised).

    The damping is added to ``reversed_h``'s own diagonal and the diagonal is put back after
    each attempt (a copy, so exactly): no damped copy of the matrix is made, and
    ``reversed_h`` is unchanged on return. The factorization is ``factor.py``'s, whose bits do
    not depend on the thread count."""
    diagonal = reversed_h.diagonal()
    undamped = diagonal.clone()
    mean_diag = torch.mean(undamped.flip(0)).item()  # summed in H's order, not the reversed one
    for step in steps:
        used = damp * step
        diagonal.add_(used * mean_diag)
        try:
            lower = cholesky_lower(reversed_h)
        finally:
            diagonal.copy_(undamped)
        if lower is not None:
            return lower, used, step != 1.0
    raise HessianNotPositiveDefinite(f"Hessian is not positive definite even with damping "
                                     f"{damp * steps[-1]:.2f} "
                                     f"({str(reversed_h.dtype).removeprefix('torch.')})")


def _upper_inverse_factor(lower: torch.Tensor) -> torch.Tensor:
    """U, the upper Cholesky factor of the damped inverse (``UᵀU = (H + λI)⁻¹``), from M of
    :func:`_damped_cholesky`: ``(H + λI)⁻¹ = J M⁻ᵀ M⁻¹ J = (J M⁻¹ J)ᵀ (J M⁻¹ J)``, and
    ``J M⁻¹ J`` is upper triangular with a positive diagonal, so it is U. That is one Cholesky
    and one triangular inverse (``factor.py``'s, the same bits at any thread count), where the
    textbook route takes a Cholesky, ``cholesky_inverse`` (LAPACK potri) and a second
    Cholesky."""
    return invert_lower(lower).flip(0, 1)


@dataclass
class HessianPrep:
    """What the sweep needs from a Hessian, whatever the weight: computed once per Hessian
    (q/k/v share theirs, and a tall matrix is quantized a few rows at a time)."""

    dead: torch.Tensor  # [K] bool: input channels that never fire
    importance: torch.Tensor  # [K] the (fixed-up) Hessian diagonal
    perm: torch.Tensor  # [K] sweep order
    hinv: torch.Tensor  # [K, K] upper Cholesky factor of the damped inverse, permuted
    damp: float
    damp_raised: bool
    fallback: str | None = None  # GPTQStats.fallback


def prepare_hessian(hessian: torch.Tensor, *, act_order: bool, damp: float) -> HessianPrep:
    """Raises :class:`HessianNotPositiveDefinite` when no damping step, in float32 or in
    float64, makes the Hessian factor. ``hessian`` is not modified.

    Memory, besides ``hessian``: a K x K copy in the factorization's order (the sweep's order
    reversed, taken in one gather) with the factorization's working copy of it; then, that copy
    dropped, the factor with the inverse being built (``factor.invert_lower``: the inverse, and
    three quarter-size products for its lower-left block). At most 2.75 float32 K x K matrices
    (the float64 fallback: twice that), which the scale suite's memory bound counts."""
    importance = torch.diag(hessian).to(torch.float32)
    dead = importance == 0
    importance[dead] = 1.0  # a channel that never fired: H[i, i] = 1, its weights zeroed
    perm = torch.argsort(importance, descending=True) if act_order else torch.arange(len(importance))
    order = perm.flip(0)
    h = hessian[order[:, None], order[None, :]].to(torch.float32)
    h.diagonal()[dead[order]] = 1.0
    try:
        lower, used_damp, raised = _damped_cholesky(h, damp)
        fallback = None
    except HessianNotPositiveDefinite:
        h = h.to(torch.float64)
        lower, used_damp, _ = _damped_cholesky(h, damp, DAMP_STEPS_FLOAT64)
        raised, fallback = True, "float64"
    del h  # before the inversion: the matrix, its factor and the inverse are never all held
    hinv = _upper_inverse_factor(lower)
    del lower
    return HessianPrep(dead, importance, perm, hinv.to(torch.float32), used_damp, raised, fallback)


def quantize_gptq(weight: torch.Tensor, hessian: torch.Tensor | HessianPrep, group_size: int,
                  grid: GridSpec, *, act_order: bool = False, damp: float = 0.01,
                  block_size: int = 128) -> tuple[GroupQuant, GPTQStats]:
    """GPTQ on the 4-bit group grid. weight [N, K] (any float dtype), hessian [K, K] float32
    (or its :func:`prepare_hessian`, made with the same ``act_order`` and ``damp``)."""
    prep = hessian if isinstance(hessian, HessianPrep) else prepare_hessian(
        hessian, act_order=act_order, damp=damp)
    w = weight.to(torch.float32).clone()
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if k % g:
        raise ValueError(f"group size {g} does not divide in-features {k}")
    n_groups = k // g

    w[:, prep.dead] = 0.0
    importance, perm, hinv = prep.importance, prep.perm, prep.hinv
    used_damp, raised = prep.damp, prep.damp_raised

    scales = torch.zeros(n, n_groups)
    zeros = None if grid.symmetric else torch.zeros(n, n_groups)
    if act_order:  # static groups: searched once, on the original weights
        imp = grouped(importance.reshape(1, k), g)
        # a few rows at a time: the search's temporaries are several copies of what it is
        # given, and every row's result is the same whatever the chunk (row-wise math)
        rows = max(1, SEARCH_CHUNK // k)
        for r0 in range(0, n, rows):
            s, z = fit_group(grouped(w[r0:r0 + rows], g), imp, grid)
            scales[r0:r0 + rows] = s.squeeze(-1)
            if zeros is not None and z is not None:
                zeros[r0:r0 + rows] = z.squeeze(-1)
    w = w[:, perm]
    group_of = torch.arange(k)[perm] // g  # group of each (permuted) column

    # signed codes a = q - 8, one row per (permuted) column
    codes_t = torch.empty(k, n, dtype=torch.int8)
    block = max(block_size // g, 1) * g if not act_order else block_size
    # The sweep is a long chain of small ops on one column at a time, so the per-column work
    # is kept to the minimum: the block is held transposed (a column is a contiguous row),
    # Python scalars for the indices and pivots, each group's scale prepared once when the
    # group changes (a zero scale becomes +inf, so its codes come out 0 without a mask), the
    # codes kept signed until the end, and the error written straight into its block row.
    # Each group's scales (and zeros) are a contiguous row of a [groups, N] table, so taking a
    # group's column is a view, not a gather; with static groups (act-order, whose column order
    # visits the groups in no order) the zero-safe scales are prepared once for all groups.
    groups = group_of.tolist()
    pivots = torch.diagonal(hinv).tolist()
    scales_t = scales.t().contiguous()
    zeros_t = None if zeros is None else zeros.t().contiguous()
    safe_t = scales_t.masked_fill(scales_t == 0, math.inf) if act_order else None
    current, s_col, z_col, safe = -1, None, None, None
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].t().contiguous()
        err1 = torch.empty_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            grp = groups[col]
            if not act_order and col % g == 0:
                imp = importance[perm[col:col + g]].reshape(1, g)
                s, z = fit_group(w1[i:i + g].t().contiguous().unsqueeze(1), imp.unsqueeze(0), grid)
                scales_t[grp] = s.reshape(n)
                if zeros_t is not None and z is not None:
                    zeros_t[grp] = z.reshape(n)
                current = -1
            if grp != current:
                current = grp
                s_col = scales_t[grp]
                z_col = None if zeros_t is None else zeros_t[grp]
                safe = safe_t[grp] if safe_t is not None else s_col.masked_fill(s_col == 0, math.inf)
            wcol = w1[i]
            target = wcol if z_col is None else wcol - z_col
            a = torch.div(target, safe).round_().clamp_(QMIN - QZERO, QMAX - QZERO)
            codes_t[col] = a
            deq = a.mul_(s_col)
            if z_col is not None:
                deq += z_col
            e = torch.sub(wcol, deq, out=err1[i]).div_(pivots[col])
            w1[i + 1:].addr_(hinv1[i, i + 1:], e, alpha=-1.0)  # row i is done
        w[:, i2:] -= err1.t() @ hinv[i1:i2, i2:]

    codes = codes_t.t().add(QZERO).to(torch.uint8)
    inv = torch.argsort(perm)
    codes = codes[:, inv].contiguous()
    scales = scales_t.t().contiguous()
    zeros = None if zeros_t is None else zeros_t.t().contiguous()
    return GroupQuant(codes, scales, zeros, g), GPTQStats(used_damp, raised, prep.fallback)


def weighted_error_terms(reference: torch.Tensor, quantized: torch.Tensor,
                         importance: torch.Tensor | None = None) -> tuple[float, float]:
    """(Σ d w², Σ d (w - ŵ)²), with d the input-channel importance ([K]) or uniform; sums over
    row blocks add up to the whole matrix's."""
    ref = reference.to(torch.float32)
    err = ref - quantized.to(torch.float32)
    d = torch.ones(ref.shape[1]) if importance is None else importance.to(torch.float32)
    return float((ref * ref * d).sum()), float((err * err * d).sum())


def snr_db(signal: float, noise: float) -> float:
    return 10.0 * math.log10(max(signal, 1e-30) / max(noise, 1e-30))


def weighted_snr_db(reference: torch.Tensor, quantized: torch.Tensor,
                    importance: torch.Tensor | None = None) -> float:
    """10·log10(Σ d w² / Σ d (w - ŵ)²), with d the input-channel importance ([K]) or uniform."""
    return snr_db(*weighted_error_terms(reference, quantized, importance))
