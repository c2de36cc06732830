"""Suite ``dist_projection``: a distributed GPTQ run of Llama-3-8B, projected from the
``distributed`` suite's measurements on the demo model.

Not a timing: a model (``benchmarks/dist_projection.py``, its worker, says what it measures
and what it assumes) run on the newest complete ``distributed`` result committed under
``benchmarks/results/``. One arm, ``llama-3-8b``; its extras hold every row of the projection
(1, 4 and 16 hosts of 32 cores over 10 GbE), the measured inputs and the assumptions. Metrics:
the best projected whole run (``best_total_hours``) and the payload check (``payload_errors``:
ranks whose bytes per layer the payload model does not reproduce exactly, must be 0).
``--source`` names the measured model's checkpoint when the result's path is not here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..harness import Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite
from .quantize import SuiteOptions, select

RESULTS = Path(__file__).resolve().parents[1] / "results"
BEST_HOURS = Metric("best_total_hours", "h", "lower")
PAYLOAD_ERRORS = Metric("payload_errors", "ranks", "lower", ratio=False)


def distributed_result(results: Path = RESULTS) -> Path:
    from ..render import newest

    path = newest(results, "distributed-2*.json", complete=True)
    if path is None:
        raise HarnessError(f"no complete distributed result in {results}")
    return path


def build(opts: SuiteOptions) -> Suite:
    measured = distributed_result()

    def command(ctx: PassContext) -> Command:
        return Command([sys.executable, "-m", "benchmarks.dist_projection", str(measured),
                        "--json", str(ctx.workdir / "projection.json"),
                        *(["--source", str(opts.source)] if opts.source else [])], timeout=600)

    def read(ctx: PassContext) -> dict:
        return json.loads((ctx.workdir / "projection.json").read_text())

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        doc = read(ctx)
        check = doc["measured"]["payload_check"]
        return {"best_total_hours": min(r["total_hours"] for r in doc["projection"]),
                "payload_errors": float(sum(check["expected"][r] != check["measured"][r]
                                            for r in check["expected"]))}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        return read(ctx)

    arm = Arm("llama-3-8b", {"input": measured.name}, command, collect, extras=extras)
    return Suite(name="dist_projection", description="Llama-3-8B quantized on several hosts, "
                 "projected from the distributed suite's demo-model run",
                 metrics=[BEST_HOURS, PAYLOAD_ERRORS], arms=select([arm], opts.arms),
                 settings={"input": measured.name}, baseline=None, inputs={"input": measured})


def projection_table(doc: dict) -> str:
    lines = ["| hosts | ranks | per layer: compute | per layer: traffic | whole run | bottleneck |",
             "|---|---|---|---|---|---|"]
    for r in doc["projection"]:
        threads = f" ({r['threads_per_rank']} threads each)" if r.get("threads_per_rank", 1) > 1 \
            else ""
        lines.append(f"| {r['hosts']} | {r['ranks']}{threads} | {r['layer_compute_seconds']} s | "
                     f"{r['layer_traffic_seconds']} s | {r['total_hours']} h | {r['bottleneck']} |")
    return "\n".join(lines)


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest projection (this suite's, or the earlier script's
    file), with the distributed run it starts from."""
    from ..render import machine, newest

    path = newest(results, "dist_projection-2*.json", complete=True)
    if path is not None:
        whole = json.loads(path.read_text())
        doc = next(r["extras"] for r in whole["records"] if r["ok"])
        sha = machine(whole)["sha"]
    else:
        found = sorted(results.glob("dist-projection-2*.json"))
        if not found:
            return "Not projected yet."
        path = found[-1]
        doc = json.loads(path.read_text())
        sha = doc["provenance"]["git"]["sha"]
    measured = results / doc["input"]
    cpu = machine(json.loads(measured.read_text())) if measured.is_file() else None
    where = f" (measured on {cpu['cpu']} ({cpu['isa']}), {cpu['cores']} cores)" if cpu else ""
    check = "reproduces" if doc["measured"]["payload_check"]["exact"] else "does NOT reproduce"
    return "\n".join([
        projection_table(doc), "",
        f"Llama-3-8B shapes, 128 x 512 calibration tokens, hosts of "
        f"{doc['assumptions']['cores_per_host']} cores over 10 GbE. The payload model {check} "
        f"the two ranks' measured bytes per layer. Measured input: "
        f"[{measured.name}]({os.path.relpath(measured, docs)}){where}; git {sha[:7]}. Command: "
        f"`python -m benchmarks run dist_projection`. Result file: "
        f"[{path.name}]({os.path.relpath(path, docs)})."])
