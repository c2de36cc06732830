"""What the thread-count-independent arithmetic of GPTQ's Hessians costs, and saves.

    python -m benchmarks.hessian_cost [--threads N] [--reps R] [--out DIR]

At the Hessian widths of the demo model (576, 1536) and of Llama-3.2-1B (2048, 8192), on one
calibration batch (8 x 512 = 4096 rows of bf16 activations with heavy-tailed channels), each
of these is timed, interleaved (A B A B ..., best of ``--reps``):

``bf16-slabs``     the product earlier versions used: bf16 GEMMs (oneDNN), 2048 rows at a
                   time, each rounded to bf16 and summed in float32 (its bits depend on the
                   GEMM kernel)
``gram``           ``hessians.gram``: exact fixed-point sums in float64, one rounding
``lapack``         ``torch.linalg.cholesky_ex`` and ``solve_triangular`` against the identity
                   (LAPACK, threaded: its bits depend on the thread count)
``blocked``        ``factor.cholesky_lower`` and ``factor.invert_lower``

and each product's largest error against the float64 product, relative to its largest entry.
Result file: ``<out>/hessian-cost-<UTC time>.json`` (atomic), with the benchmark provenance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import provenance
from .harness import write_result

RESULTS = Path(__file__).resolve().parent / "results"
WIDTHS = (576, 1536, 2048, 8192)
ROWS = 4096


def bf16_slabs(x):
    """The bf16-slab product of earlier versions (upper blocks and symmetry left out: the
    same GEMM work per entry)."""
    import torch

    mm = torch.backends.mkldnn.matmul
    previous = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        total = None
        for slab in torch.split(x, 2048):
            block = (slab.t() @ slab).to(torch.float32)
            total = block if total is None else total.add_(block)
        return total
    finally:
        mm.fp32_precision = previous


def lapack(h):
    import torch

    lower, _ = torch.linalg.cholesky_ex(h)
    return torch.linalg.solve_triangular(lower, torch.eye(h.shape[0]), upper=False)


def blocked(h):
    from cpu_quant.quantize.factor import cholesky_lower, invert_lower

    return invert_lower(cholesky_lower(h))


def measure(reps: int) -> list[dict]:
    import torch

    from cpu_quant.quantize.hessians import gram

    gen = torch.Generator().manual_seed(0)
    rows = []
    for k in WIDTHS:
        x = (torch.randn(ROWS, k, generator=gen) * torch.rand(k, generator=gen).pow(3).mul(20)
             .add(0.1)).to(torch.bfloat16)
        exact = x.double().t() @ x.double()
        h = (2 * gram(x) / ROWS)
        h.diagonal().add_(0.01 * h.diagonal().mean())
        arms = {"bf16-slabs": (bf16_slabs, x), "gram": (gram, x), "lapack": (lapack, h),
                "blocked": (blocked, h)}
        best = {name: float("inf") for name in arms}
        for r in range(reps):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                fn, arg = arms[name]
                t0 = time.perf_counter()
                fn(arg)
                best[name] = min(best[name], time.perf_counter() - t0)
        errors = {name: float((fn(x).double() - exact).abs().max() / exact.abs().max())
                  for name, fn in (("bf16-slabs", bf16_slabs), ("gram", gram))}
        rows.append({"k": k, "rows": ROWS, "seconds": {n: round(v, 4) for n, v in best.items()},
                     "gram_over_bf16_slabs": round(best["gram"] / best["bf16-slabs"], 3),
                     "blocked_over_lapack": round(best["blocked"] / best["lapack"], 3),
                     "max_error_relative": errors})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hessian_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.reps)
    prov = provenance.collect({"widths": list(WIDTHS), "rows": ROWS, "reps": args.reps,
                               "threads": torch.get_num_threads()})
    provenance.validate(prov)
    doc = {"suite": "hessian-cost", "notes": args.note, "rows": rows, "provenance": prov}
    path = write_result(args.out, "hessian-cost", doc)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
