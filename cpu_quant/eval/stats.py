"""Summary statistics of an evaluation, with standard errors as ``llama-perplexity`` reports them.

Every statistic is computed from per-position values (one per scored token):

* KL divergence: mean ± standard error ``sqrt(var / (n - 1))``, median, p90, p99 and max;
* perplexity ``exp(mean NLL)`` ± ``ppl · se(mean NLL)`` (the delta method, as llama.cpp's
  ``perplexity.cpp`` does); the perplexity difference ± the delta method with the covariance
  of the two models' NLLs, since both score the same tokens;
* "same top-1" (the argmaxes agree) ± the binomial ``sqrt(p (1 - p) / (n - 1))``.

The positions of one window are not independent, so these errors are a lower bound on the
error of the corpus mean (llama.cpp makes the same assumption).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass
class Estimate:
    value: float
    stderr: float

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self, digits: int = 4) -> str:
        return f"{self.value:.{digits}f} ± {self.stderr:.{digits}f}"


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).double()


def mean_estimate(x: torch.Tensor) -> Estimate:
    x = _f64(x)
    n = x.numel()
    if n < 2:
        return Estimate(float(x.mean()) if n else math.nan, math.nan)
    return Estimate(float(x.mean()), float(x.var(unbiased=True).sqrt()) / math.sqrt(n))


def quantile(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(_f64(x), q))


def kl_summary(kl: torch.Tensor) -> dict:
    """``mean``, ``stderr``, ``median``, ``p90``, ``p99``, ``max`` of per-position KL values."""
    x = _f64(kl)
    est = mean_estimate(x)
    return {"mean": est.value, "stderr": est.stderr, "median": quantile(x, 0.5),
            "p90": quantile(x, 0.9), "p99": quantile(x, 0.99), "max": float(x.max())}


def perplexity(nll: torch.Tensor) -> Estimate:
    """``exp(mean NLL)`` with the delta-method error ``ppl · se(mean NLL)``."""
    est = mean_estimate(nll)
    ppl = math.exp(est.value)
    return Estimate(ppl, ppl * est.stderr)


def perplexity_delta(nll_quant: torch.Tensor, nll_ref: torch.Tensor) -> Estimate:
    """``PPL(quant) - PPL(ref)`` on the same tokens, its error from the NLLs' covariance."""
    q, r = _f64(nll_quant), _f64(nll_ref)
    n = q.numel()
    ppl_q, ppl_r = math.exp(float(q.mean())), math.exp(float(r.mean()))
    if n < 2:
        return Estimate(ppl_q - ppl_r, math.nan)
    cov = torch.cov(torch.stack([q, r]))  # unbiased
    var = (ppl_q**2 * cov[0, 0] + ppl_r**2 * cov[1, 1] - 2 * ppl_q * ppl_r * cov[0, 1]) / n
    return Estimate(ppl_q - ppl_r, float(var.clamp_min(0).sqrt()))


def proportion(hits: torch.Tensor) -> Estimate:
    """The fraction of true values with the binomial error ``sqrt(p (1 - p) / (n - 1))``."""
    x = _f64(hits.float())
    n = x.numel()
    p = float(x.mean())
    return Estimate(p, math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else math.nan)


KL_HISTOGRAM_EDGES = [0.0] + [10.0 ** (e / 4) for e in range(-20, 5)]  # 0, 1e-5 ... 10, then +inf


def kl_histogram(kl: torch.Tensor) -> dict:
    """Counts of per-position KL in log-spaced bins (``edges[i] <= kl < edges[i + 1]``; the last
    bin is open): what ``cpu-quant report`` plots."""
    x = _f64(kl)
    edges = torch.tensor(KL_HISTOGRAM_EDGES + [math.inf], dtype=torch.float64)
    idx = torch.bucketize(x.clamp_min(0), edges, right=True) - 1
    counts = torch.bincount(idx.clamp(0, len(edges) - 2), minlength=len(edges) - 1)
    return {"edges": KL_HISTOGRAM_EDGES, "counts": [int(c) for c in counts]}
