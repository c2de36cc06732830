"""Suite ``core_scaling``: how much two processes gain over one on this host, the bound on a
two-rank speed-up.

A two-rank GPTQ run (``cpu-quant gptq --nproc 2``, one torch thread per rank) can be at best as
fast as this machine lets two single-threaded processes compute side by side. Two vCPUs of a
virtual machine may be two hyperthreads of one core, or share memory bandwidth, so two
processes can each run slower than one alone. Arms, per workload (``forward``, ``gram``: the
pass worker ``benchmarks/core_scaling.py`` says what each computes): ``solo-W``, one process
with one thread pinned to CPU 0 (the baseline); ``pair-W``, two such processes started
together on CPUs 0 and 1. Metric: operations per second, the pair's summed over both
processes; the pair's ratio to the solo rate is the scaling (2.0 = two full cores), and its
inverse the smallest wall-time ratio two ranks can reach on perfectly split work of that kind.
Smoke mode: one second per process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..core_scaling import ARMS, WORKLOADS
from ..harness import Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite
from ..render import harness_block
from .quantize import SuiteOptions, select

RATE = Metric("rate", "op/s", "higher")
SECONDS = 8.0


def build(opts: SuiteOptions) -> Suite:
    if (os.cpu_count() or 1) < 2:
        raise HarnessError("this host has one CPU: there is no pair to measure")
    seconds = 1.0 if opts.smoke else SECONDS

    def arm(kind: str, workload: str) -> Arm:
        def command(ctx: PassContext) -> Command:
            return Command([sys.executable, "-m", "benchmarks.core_scaling", "--arm", kind,
                            "--workload", workload, "--seconds", str(seconds),
                            "--json", str(ctx.workdir / "pass.json")], timeout=600)

        def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
            return {"rate": json.loads((ctx.workdir / "pass.json").read_text())["rate"]}

        def extras(ctx: PassContext, run: RunRecord) -> dict:
            return {"rates": json.loads((ctx.workdir / "pass.json").read_text())["rates"]}

        return Arm(f"{kind}-{workload}", {"processes": 1 if kind == "solo" else 2,
                                          "threads_per_process": 1, "workload": workload,
                                          "seconds": seconds}, command, collect, extras=extras)

    arms = select([arm(kind, w) for w in WORKLOADS for kind in ARMS], opts.arms)
    names = {a.name for a in arms}
    baseline_of = {a.name: (f"solo-{a.settings['workload']}"
                            if f"solo-{a.settings['workload']}" in names else a.name)
                   for a in arms}
    return Suite(name="core_scaling", description="two pinned single-thread processes against "
                 "one: the bound on a two-rank speed-up", metrics=[RATE], arms=arms,
                 settings={"seconds": seconds, "pinning": "taskset CPU 0 (solo); CPUs 0 and 1 "
                           "(pair)", "workloads": {"forward": "bf16 [4096x576] @ [576x1536]",
                                                   "gram": "gram() of bf16 [4096x1536]"}},
                 baseline=None, baseline_of=baseline_of)


def _bound(arm: str, doc: dict) -> str:
    cmp = doc.get("comparisons", {}).get(arm, {}).get("rate")
    if not cmp or not cmp.get("ratio_passes"):
        return "—"
    return f"×{1 / cmp['ratio_median']:.3f}"


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table, with each pair's bound on
    the two-rank wall time (the inverse of its median scaling)."""
    return harness_block(results, docs, "core_scaling", "python -m benchmarks run core_scaling",
                         {"two ranks' best wall time": _bound})
