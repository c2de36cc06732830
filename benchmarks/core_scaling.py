"""The pass worker of the ``core_scaling`` suite (``benchmarks/suites/core_scaling.py``): one
arm's rate of one workload, in one process pinned to CPU 0 (``solo``) or two started together,
pinned to CPUs 0 and 1 (``pair``), each with one torch thread.

    python -m benchmarks.core_scaling --arm solo|pair --workload forward|gram [--seconds S] --json OUT

Workloads, at the demo model's shapes (what dominates a calibration layer):

``forward``  bf16 GEMM of a calibration batch through an MLP projection,
             [4096 x 576] @ [576 x 1536] (the layer-streaming forward passes)
``gram``     XᵀX of a bf16 batch [4096 x 1536] through ``cpu_quant.quantize.hessians.gram``
             (the Hessian products)

Each process repeats the operation for ``S`` seconds after one warm-up call. Output:
``{"rate": the processes' total operations per second, "rates": [each process's]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import provenance

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.core_scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--workload", choices=WORKLOADS)
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds per process")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(run_workload(args.worker, args.seconds))
        return 0
    if not (args.arm and args.workload and args.json):
        ap.error("--arm, --workload and --json are required")
    if args.arm == "pair" and (os.cpu_count() or 1) < 2:
        print("error: this host has one CPU: there is no pair to measure", file=sys.stderr)
        return 2
    rates = run_arm(args.arm, args.workload, args.seconds)
    doc = {"rate": sum(rates), "rates": rates, "seconds": args.seconds}
    args.json.write_text(json.dumps(doc))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
