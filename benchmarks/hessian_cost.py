"""The pass worker of the ``hessian_cost`` suite (``benchmarks/suites/hessian_cost.py``): times
one operation at one width in this process and writes its JSON.

    python -m benchmarks.hessian_cost --op OP --k K [--reps R] --json OUT

``OP`` is one of :data:`OPS` (what each computes: the suite's docstring). The input is one
calibration batch of :data:`ROWS` rows of bf16 activations with heavy-tailed channels (seeded);
the factorizations take the damped Hessian ``2 gram(X) / rows + 1% of its mean diagonal``.
Output: ``{"seconds": best of R calls, "k", "rows", "threads"}`` and, for the two products,
``max_error_relative``: the largest error against the float64 product over its largest entry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

WIDTHS = (576, 1536, 2048, 8192)
ROWS = 4096
OPS = ("bf16-slabs", "gram", "lapack", "blocked")


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


def measure(op: str, k: int, reps: int) -> dict:
    import torch

    from cpu_quant.quantize.hessians import gram

    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(ROWS, k, generator=gen) * torch.rand(k, generator=gen).pow(3).mul(20)
         .add(0.1)).to(torch.bfloat16)
    products = {"bf16-slabs": bf16_slabs, "gram": gram}
    if op in products:
        fn, arg = products[op], x
    else:
        h = 2 * gram(x) / ROWS
        h.diagonal().add_(0.01 * h.diagonal().mean())
        fn, arg = {"lapack": lapack, "blocked": blocked}[op], h
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(arg)
        best = min(best, time.perf_counter() - t0)
    doc = {"seconds": best, "k": k, "rows": ROWS, "threads": torch.get_num_threads()}
    if op in products:
        exact = x.double().t() @ x.double()
        doc["max_error_relative"] = float((out.double() - exact).abs().max() / exact.abs().max())
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hessian_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=OPS, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    doc = measure(args.op, args.k, args.reps)
    args.json.write_text(json.dumps(doc))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
