"""Activation smoothing (SmoothQuant, Xiao et al. 2022) as pure tensor math.

A linear ``y = x Wᵀ`` computes the same ``y`` with ``x' = x / s`` and ``W' = W · diag(s)`` for
any positive per-input-channel ``s``. When ``x`` is quantized per token (the 8da schemes'
dynamic int8), a few channels of very large magnitude set every token's step; dividing them by
``s`` moves that range into the weights, whose 8-bit per-channel grid has room for it. The
division is folded into whatever produces ``x`` (a norm's weight, or the rows of the linear
before), so the float model is unchanged up to rounding.

``s_j = max|x_j|^α / max|W_{:,j}|^(1-α)`` (the paper's rule; ``α = 0.5`` balances the two),
where ``max|x_j|`` is measured on calibration text and ``max|W_{:,j}|`` over every linear that
reads ``x``.
"""

from __future__ import annotations

import torch

from ..core.smoothing_factors import row_blocks

DEFAULT_ALPHA = 0.5


def column_absmax(w: torch.Tensor) -> torch.Tensor:
    """``max |W[:, j]|`` per column, a block of rows at a time (exact: a maximum does not
    depend on the order)."""
    w = w.detach()
    out = None
    for rows in row_blocks(w):
        block = w[rows].abs().amax(0)
        out = block if out is None else torch.maximum(out, block)
    return out


def weights_absmax(weights: list[torch.Tensor]) -> torch.Tensor:
    """``max |W[:, j]|`` per column over every linear of ``weights`` (float32 [K])."""
    return torch.stack([column_absmax(w) for w in weights]).amax(0).to(torch.float32)


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor],
                     alpha: float = DEFAULT_ALPHA, w_max: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """``s`` [K] for the linears ``weights`` ([N_i, K] each) that share the input whose
    per-channel ``max|x|`` is ``act_absmax`` [K]. Channels that never fire (or whose weights are
    all zero) keep ``s = 1``. ``w_max``: :func:`weights_absmax` of ``weights``, when already
    computed (it does not depend on ``alpha``)."""
    if w_max is None:
        w_max = weights_absmax(weights)
    a_max = act_absmax.to(torch.float32)
    s = a_max.pow(alpha) / w_max.pow(1 - alpha)
    ok = (a_max > 0) & (w_max > 0) & torch.isfinite(s) & (s > 0)
    return torch.where(ok, s, torch.ones_like(s))
