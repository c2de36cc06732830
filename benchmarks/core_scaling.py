"""How much two processes gain over one on this host: the bound on a two-rank speed-up.

    python -m benchmarks.core_scaling [--passes 3] [--seconds 8] [--smoke] [--out DIR]

A two-rank GPTQ run (``cpu-quant gptq --nproc 2``, one torch thread per rank) can be at best as
fast as this machine lets two single-threaded processes compute side by side. Two vCPUs of a
virtual machine may be two hyperthreads of one core, or share memory bandwidth, so two
processes can each run slower than one alone. This benchmark measures that directly, on the
two kinds of work that dominate a calibration layer, at the demo model's shapes:

``forward``  bf16 GEMM of a calibration batch through an MLP projection,
             [4096 x 576] @ [576 x 1536] (the layer-streaming forward passes)
``gram``     XᵀX of a bf16 batch [4096 x 1536] through ``cpu_quant.quantize.hessians.gram``
             (the Hessian products)

Arms, interleaved with the order rotated every pass (>= 3 passes unless ``--smoke``): ``solo``,
one process with one thread pinned to CPU 0; ``pair``, two such processes started together,
pinned to CPUs 0 and 1. Each process repeats the operation for ``--seconds`` and reports its
rate (operations per second). Per pass and workload the result gives the pair's total rate
over the solo rate (2.0 = two full cores) and its inverse, the smallest wall-time ratio two
ranks can reach on perfectly split work of that kind: ``bound = 1 / (pair total / solo)``.

Result: ``benchmarks/results/core-scaling[-smoke]-<UTC time>.json``, with provenance.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import provenance
from .harness import MIN_PASSES, rotated_order, spread, write_result

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("forward", "gram")
ARMS = ("solo", "pair")


def run_workload(workload: str, seconds: float) -> float:
    """Operations per second of ``workload`` in this process (one torch thread)."""
    import torch

    from cpu_quant.quantize.hessians import gram

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    if workload == "forward":
        x = torch.randn(4096, 576, generator=g).to(torch.bfloat16)
        w = torch.randn(576, 1536, generator=g).to(torch.bfloat16)

        def op() -> None:
            x @ w
    elif workload == "gram":
        x = torch.randn(4096, 1536, generator=g).to(torch.bfloat16)

        def op() -> None:
            gram(x)
    else:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    op()  # warm-up: oneDNN's kernel choice, first-touch of the buffers
    n, t0 = 0, time.perf_counter()
    while True:
        op()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n / elapsed


def _worker_cmd(workload: str, seconds: float) -> list[str]:
    return [sys.executable, "-m", "benchmarks.core_scaling", "--worker", workload,
            "--seconds", str(seconds)]


def run_arm(arm: str, workload: str, seconds: float) -> list[float]:
    """Each process's rate for one arm: one process on CPU 0, or two on CPUs 0 and 1."""
    cpus = [0] if arm == "solo" else [0, 1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = []
    for cpu in cpus:
        procs.append(subprocess.Popen(["taskset", "-c", str(cpu), *_worker_cmd(workload, seconds)],
                                      cwd=provenance.REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    rates = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{arm}/{workload}: exit {proc.returncode}: {err.strip()[-500:]}")
        rates.append(float(out.strip().splitlines()[-1]))
    return rates


def summarize(passes: list[dict]) -> dict:
    out = {}
    for workload in WORKLOADS:
        scaling = [p[workload]["pair_total_over_solo"] for p in passes]
        bound = [p[workload]["best_two_rank_wall_ratio"] for p in passes]
        out[workload] = {"pair_total_over_solo": {"values": scaling,
                                                  "median": statistics.median(scaling),
                                                  "spread": spread(scaling)},
                         "best_two_rank_wall_ratio": {"values": bound,
                                                      "median": statistics.median(bound),
                                                      "min": min(bound), "max": max(bound)}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.core_scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=MIN_PASSES)
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds per process and arm")
    ap.add_argument("--smoke", action="store_true", help="one short pass (checks the machinery)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(run_workload(args.worker, args.seconds))
        return 0
    if not args.smoke and args.passes < MIN_PASSES:
        print(f"error: a measurement needs at least {MIN_PASSES} passes", file=sys.stderr)
        return 2
    if (os.cpu_count() or 1) < 2:
        print("error: this host has one CPU: there is no pair to measure", file=sys.stderr)
        return 2
    passes_n = 1 if args.smoke else args.passes
    seconds = min(args.seconds, 1.0) if args.smoke else args.seconds
    passes = []
    for p in range(passes_n):
        record: dict = {"pass": p}
        for workload in WORKLOADS:
            rates = {}
            for arm in rotated_order(ARMS, p):
                rates[arm] = run_arm(arm, workload, seconds)
                print(f"core_scaling: pass {p} {workload} {arm}: "
                      f"{', '.join(f'{r:.2f}' for r in rates[arm])} op/s", file=sys.stderr)
            total = sum(rates["pair"]) / rates["solo"][0]
            record[workload] = {"order": rotated_order(ARMS, p), "solo_rate": rates["solo"][0],
                                "pair_rates": rates["pair"], "pair_total_over_solo": total,
                                "best_two_rank_wall_ratio": 1.0 / total}
        passes.append(record)
    settings = {"passes": passes_n, "seconds": seconds, "smoke": args.smoke,
                "workloads": {"forward": "bf16 [4096x576] @ [576x1536]",
                              "gram": "gram() of bf16 [4096x1536]"},
                "threads_per_process": 1, "pinning": "taskset CPU 0 (solo); CPUs 0 and 1 (pair)"}
    prov = provenance.collect(settings)
    provenance.validate(prov)
    doc = {"suite": "core-scaling", "smoke": args.smoke, "passes": passes,
           "summary": summarize(passes), "provenance": prov}
    path = write_result(args.out, f"core-scaling{'-smoke' if args.smoke else ''}", doc)
    for workload, s in doc["summary"].items():
        print(f"{workload}: pair/solo {s['pair_total_over_solo']['median']:.2f} "
              f"(best two-rank wall ratio {s['best_two_rank_wall_ratio']['median']:.3f})")
    print(f"core_scaling: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
