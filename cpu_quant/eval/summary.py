"""The fidelity table the CLI prints, one column per variant, with standard errors."""

from __future__ import annotations

import math


def _get(r, name: str, default=math.nan):
    return r.get(name, default) if isinstance(r, dict) else getattr(r, name, default)


def _pm(value: float, err: float, digits: int, sign: str = "") -> str:
    if err is None or not math.isfinite(err):
        return f"{value:{sign}.{digits}f}"
    return f"{value:{sign}.{digits}f} ± {err:.{digits}f}"


ROWS = [
    ("KL(bf16 || quant)", lambda r: _pm(_get(r, "kl_mean"), _get(r, "kl_stderr"), 4)),
    ("  median / p90", lambda r: f"{_get(r, 'kl_median'):.4f} / {_get(r, 'kl_p90'):.4f}"),
    ("  p99 / max", lambda r: f"{_get(r, 'kl_p99'):.3f} / {_get(r, 'kl_max'):.2f}"),
    ("perplexity", lambda r: _pm(_get(r, "ppl_quantized"), _get(r, "ppl_quantized_stderr"), 2)),
    ("  vs bf16", lambda r: _pm(_get(r, "ppl_delta"), _get(r, "ppl_delta_stderr"), 3, "+")),
    ("same top-1", lambda r: _pm(_get(r, "top1_agreement"), _get(r, "top1_stderr"), 3)),
    ("greedy reproduction", lambda r: f"{_get(r, 'greedy_prefix_fraction'):.3f} "
                                      f"({_get(r, 'greedy_exact')} exact)"),
]


def fidelity_lines(reports: dict) -> list[str]:
    """The table for ``{variant: FidelityReport or its dict}``."""
    names = list(reports)
    first = reports[names[0]]
    width = max(20, *(len(fmt(reports[n])) + 2 for n in names for _, fmt in ROWS))
    lines = ["", f"  fidelity vs the bf16 source, held-out text ({_get(first, 'tokens')} tokens "
                 f"scored, {_get(first, 'greedy_prompts')} greedy prompts; ± is one standard error)",
             "    " + f"{'':<22}" + "".join(f"{n:>{width}}" for n in names)]
    for label, fmt in ROWS:
        lines.append("    " + f"{label:<22}" + "".join(f"{fmt(reports[n]):>{width}}" for n in names))
    ppl_ref = _pm(_get(first, "ppl_reference"), _get(first, "ppl_reference_stderr"), 2)
    lines.append(f"    (bf16 perplexity {ppl_ref}; KL: {_get(first, 'kl_source', 'full')})")
    return lines
