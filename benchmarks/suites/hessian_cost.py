"""Suite ``hessian_cost``: what the thread-count-independent arithmetic of GPTQ's Hessians costs.

At the Hessian widths of the demo model (576, 1536) and of Llama-3.2-1B (2048, 8192), on one
calibration batch (8 x 512 = 4096 rows of bf16 activations with heavy-tailed channels), one
arm per operation and width (the pass worker is ``benchmarks/hessian_cost.py``):

``bf16-slabs-K``  the product earlier versions used: bf16 GEMMs (oneDNN), 2048 rows at a time,
                  each rounded to bf16 and summed in float32 (its bits depend on the GEMM
                  kernel); the baseline of ``gram-K``
``gram-K``        ``hessians.gram``: exact fixed-point sums in float64, one rounding
``lapack-K``      ``torch.linalg.cholesky_ex`` and ``solve_triangular`` against the identity
                  (LAPACK, threaded: its bits depend on the thread count); the baseline of
                  ``blocked-K``
``blocked-K``     ``factor.cholesky_lower`` and ``factor.invert_lower``

Metric: the best time of ``reps`` calls in the pass's process, with torch's default threads
(every core). Extras of the products: the largest error against the float64 product, relative
to its largest entry. Smoke mode: widths 64 and 128, one call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..harness import Arm, Command, Metric, PassContext, RunRecord, Suite
from ..hessian_cost import OPS, ROWS, WIDTHS
from ..render import harness_block
from .quantize import SuiteOptions, select

SECONDS = Metric("seconds", "s", "lower")
BASELINE_OF = {"gram": "bf16-slabs", "blocked": "lapack"}
REPS = 5
SMOKE_WIDTHS = (64, 128)


def build(opts: SuiteOptions) -> Suite:
    widths = SMOKE_WIDTHS if opts.smoke else WIDTHS
    reps = 1 if opts.smoke else REPS

    def arm(op: str, k: int) -> Arm:
        def command(ctx: PassContext) -> Command:
            return Command([sys.executable, "-m", "benchmarks.hessian_cost", "--op", op,
                            "--k", str(k), "--reps", str(reps),
                            "--json", str(ctx.workdir / "pass.json")], timeout=1800)

        def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
            return {"seconds": json.loads((ctx.workdir / "pass.json").read_text())["seconds"]}

        def extras(ctx: PassContext, run: RunRecord) -> dict:
            doc = json.loads((ctx.workdir / "pass.json").read_text())
            return {k2: v for k2, v in doc.items() if k2 != "seconds"}

        return Arm(f"{op}-{k}", {"op": op, "k": k, "rows": ROWS, "reps": reps}, command,
                   collect, extras=extras)

    arms = [arm(op, k) for k in widths for op in OPS]
    arms = select(arms, opts.arms)
    names = {a.name for a in arms}
    baseline_of = {}
    for a in arms:
        op, k = a.settings["op"], a.settings["k"]
        base = f"{BASELINE_OF.get(op, op)}-{k}"
        baseline_of[a.name] = base if base in names else a.name
    return Suite(name="hessian_cost", description="GPTQ's Hessian product and factor: the "
                 "exact, thread-count-independent arithmetic against the earlier one",
                 metrics=[SECONDS], arms=arms, settings={"widths": list(widths), "rows": ROWS,
                                                         "reps": reps},
                 baseline=None, baseline_of=baseline_of)


def _error(arm: str, doc: dict) -> str:
    errors = [r["extras"].get("max_error_relative") for r in doc["records"]
              if r["arm"] == arm and r.get("ok")]
    errors = [e for e in errors if e is not None]
    return f"{max(errors):.1e}" if errors else "—"


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table."""
    return harness_block(results, docs, "hessian_cost", "python -m benchmarks run hessian_cost",
                         {"largest error, relative": _error},
                         all_arms=[f"{op}-{k}" for k in WIDTHS for op in OPS])
