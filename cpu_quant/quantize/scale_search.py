"""Per-group scale search, weighted by input-channel importance.

Objective, per group of ``g`` weights ``w`` with importance ``d`` (the Hessian diagonal
``E[x²]`` of those input channels; uniform without calibration)::

    E(s) = Σ_i d_i (w_i - (q_i(s) - 8) s)²

``E`` approximates what the layer's *outputs* feel (``E[(x·Δw)²]`` with the off-diagonal terms
dropped); an unweighted search ignores that and, measured on the demo model, made RTN worse
than no search at all. Candidates:

* the plain absmax scale ``amax / 8`` (so the search can never lose to it);
* ``±amax / d`` for divisors ``d`` on a grid from shrinking to growing the range, with both
  signs, so the group's signed extreme may land on the otherwise unused ``-8`` level;
* each candidate's codes get a weighted least-squares refit of the scale
  ``s* = Σ d w (q-8) / Σ d (q-8)²``, rounded to bf16, and the refit is iterated from the best.

Every candidate's error is evaluated with the bf16 scale that will be stored, and the minimum
is kept, so the result's weighted error is never above the absmax baseline's (a property the
tests check over random and outlier-heavy groups).

The asymmetric variant (for the tinygemm layout, ``w = (q-8) s + z``) searches over shrinking
both ends of the range and refits ``(s, z)`` jointly by weighted least squares.
"""

from __future__ import annotations

import torch

from .grid import QMAX, QMIN, QZERO, dequantize_codes, quantize_codes, round_scale

# Divisors of the group's absmax: below 8 grows the step (clipping less often impossible,
# fewer levels used), above 8 shrinks it (clips the extreme). 8 is plain absmax.
SYM_DIVISORS = tuple(x / 8 for x in range(40, 77))  # 5.0 .. 9.5 in steps of 1/8
REFIT_ROUNDS = 3


def _weighted_error(w: torch.Tensor, d: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                    z: torch.Tensor | None = None) -> torch.Tensor:
    err = w - dequantize_codes(q, s, z)
    return (err * err * d).sum(-1)


def absmax_scales(w: torch.Tensor) -> torch.Tensor:
    """Plain RTN: ``amax / 8`` per group (last dim), rounded to bf16. Shape [..., 1]."""
    return round_scale(w.abs().amax(-1, keepdim=True) / QZERO)


def _refit_symmetric(w: torch.Tensor, d: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    a = q - QZERO
    num = (d * w * a).sum(-1, keepdim=True)
    den = (d * a * a).sum(-1, keepdim=True)
    refit = torch.where(den > 0, num / den.clamp_min(1e-30), s)
    return round_scale(refit)


def search_symmetric_scales(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Best symmetric scale per group.

    w: float32 [..., g] (groups along the last dim). importance: broadcastable to ``w``, >= 0,
    or None for uniform. Returns bf16-representable float32 scales of shape [..., 1].
    """
    w = w.to(torch.float32)
    d = torch.ones_like(w) if importance is None else importance.to(torch.float32).expand_as(w)
    # Channels that never fire carry no error signal; a tiny floor keeps the refit defined.
    d = d + 1e-12 * d.mean(-1, keepdim=True).clamp_min(1e-30)
    idx = w.abs().argmax(-1, keepdim=True)
    extreme = torch.gather(w, -1, idx)  # signed value of largest magnitude

    best_s = absmax_scales(w)
    best_q = quantize_codes(w, best_s)
    best_e = _weighted_error(w, d, best_q, best_s)

    def consider(s: torch.Tensor) -> None:
        nonlocal best_s, best_e
        q = quantize_codes(w, s)
        e = _weighted_error(w, d, q, s)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_s = torch.where(better.unsqueeze(-1), s, best_s)

    for div in SYM_DIVISORS:
        for sign in (-1.0, 1.0):
            s = round_scale(sign * extreme / div)
            consider(s)
            consider(_refit_symmetric(w, d, quantize_codes(w, s), s))
    for _ in range(REFIT_ROUNDS):
        consider(_refit_symmetric(w, d, quantize_codes(w, best_s), best_s))
    return best_s


def weighted_error(w: torch.Tensor, scale: torch.Tensor, importance: torch.Tensor | None = None,
                   zero: torch.Tensor | None = None) -> torch.Tensor:
    """Σ d (w - ŵ)² per group for the given scale (and zero); used by tests and reports."""
    w = w.to(torch.float32)
    d = torch.ones_like(w) if importance is None else importance.to(torch.float32).expand_as(w)
    return _weighted_error(w, d, quantize_codes(w, scale, zero), scale, zero)


# Asymmetric grid: ends of the range shrunk by these fractions, independently.
ASYM_SHRINK = tuple(1.0 - x / 40 for x in range(0, 13))  # 1.0 .. 0.7


def minmax_scales_zeros(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain asymmetric RTN: [min, max] spread over the 16 levels. Shapes [..., 1]."""
    lo = w.amin(-1, keepdim=True)
    hi = w.amax(-1, keepdim=True)
    return _scale_zero_for_range(lo, hi)


def _scale_zero_for_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = round_scale((hi - lo) / (QMAX - QMIN))
    # lo sits on code 0: lo = (0 - 8) s + z  =>  z = lo + 8 s
    z = round_scale(lo + QZERO * s)
    return s, z


def _refit_asymmetric(w: torch.Tensor, d: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                      z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = q - QZERO
    sd = d.sum(-1, keepdim=True)
    sa = (d * a).sum(-1, keepdim=True)
    saa = (d * a * a).sum(-1, keepdim=True)
    sw = (d * w).sum(-1, keepdim=True)
    saw = (d * a * w).sum(-1, keepdim=True)
    det = sd * saa - sa * sa
    ok = det.abs() > 1e-20 * (sd * saa).abs().clamp_min(1e-30)
    safe = torch.where(ok, det, torch.ones_like(det))
    s_new = torch.where(ok, (sd * saw - sa * sw) / safe, s)
    z_new = torch.where(ok, (saa * sw - sa * saw) / safe, z)
    return round_scale(s_new), round_scale(z_new)


def search_asymmetric_scales(w: torch.Tensor, importance: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Best (scale, zero) per group for ``w = (q-8) s + z``. Shapes [..., 1] each."""
    w = w.to(torch.float32)
    d = torch.ones_like(w) if importance is None else importance.to(torch.float32).expand_as(w)
    d = d + 1e-12 * d.mean(-1, keepdim=True).clamp_min(1e-30)
    lo = w.amin(-1, keepdim=True)
    hi = w.amax(-1, keepdim=True)
    best_s, best_z = _scale_zero_for_range(lo, hi)
    best_e = _weighted_error(w, d, quantize_codes(w, best_s, best_z), best_s, best_z)

    def consider(s: torch.Tensor, z: torch.Tensor) -> None:
        nonlocal best_s, best_z, best_e
        e = _weighted_error(w, d, quantize_codes(w, s, z), s, z)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_s = torch.where(better.unsqueeze(-1), s, best_s)
        best_z = torch.where(better.unsqueeze(-1), z, best_z)

    for f_lo in ASYM_SHRINK:
        for f_hi in ASYM_SHRINK:
            s, z = _scale_zero_for_range(lo * f_lo, hi * f_hi)
            consider(s, z)
            consider(*_refit_asymmetric(w, d, quantize_codes(w, s, z), s, z))
    for _ in range(REFIT_ROUNDS):
        consider(*_refit_asymmetric(w, d, quantize_codes(w, best_s, best_z), best_s, best_z))
    return best_s, best_z
