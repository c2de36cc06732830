"""Suite ``memory_cap``: quantize a model larger than the memory the run may use.

One arm, ``depth-8x-cap-1024``: the memory suite's synthetic model at 8 times the demo model's
30 layers (1.75 GB of bf16) quantized by ``cpu-quant gptq`` (8 x 512 calibration tokens) inside
a memory cgroup with a hard limit of 1 GiB (the worker ``benchmarks/memory_cap.py``; needs
root). Metrics: the tree's peak RssAnon (the harness's), and the cgroup's OOM kills (must stay
0: a pass whose run did not complete fails). Extras: the cgroup's peak usage and failcnt, the
model's size.

Smoke mode: the smoke shapes (hidden 64) at 1x depth under the same cap.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..harness import PEAK_RSS_ANON, Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite
from .quantize import TIMEOUT_REAL, TIMEOUT_SMOKE, SuiteOptions, select

OOM_KILLS = Metric("oom_kills", "kills", "lower", ratio=False)
REAL = {"depth": 8, "cap_mib": 1024, "samples": 8, "seqlen": 512}
SMOKE = {"depth": 1, "cap_mib": 1024, "samples": 4, "seqlen": 64}


def build(opts: SuiteOptions) -> Suite:
    settings = SMOKE if opts.smoke else REAL
    name = f"depth-{settings['depth']}x-cap-{settings['cap_mib']}"

    def command(ctx: PassContext) -> Command:
        argv = [sys.executable, "-m", "benchmarks.memory_cap", "--json",
                str(ctx.workdir / "cap.json"), "--workdir", str(opts.workdir / "inputs"),
                *(f"--{k.replace('_', '-')}={v}" for k, v in settings.items())]
        return Command(argv + (["--smoke"] if opts.smoke else []),
                       timeout=TIMEOUT_SMOKE if opts.smoke else TIMEOUT_REAL)

    def read(ctx: PassContext) -> dict:
        doc = json.loads((ctx.workdir / "cap.json").read_text())
        if not doc["completed"]:
            raise HarnessError(f"the capped run did not complete (exit {doc['exit_status']})")
        return doc

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        return {"oom_kills": float(read(ctx)["cgroup"]["oom_kill"])}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        doc = read(ctx)
        return {"model": doc["model"], "cap_bytes": doc["cap_bytes"], "cgroup": doc["cgroup"],
                "run_peak_rss_anon_bytes": doc["rss"].get("peak_rss_anon_bytes"),
                "run_wall_seconds": doc["wall_seconds"]}

    arm = Arm(name, dict(settings), command, collect, extras=extras)
    return Suite(name="memory_cap", description="cpu-quant gptq on a model larger than a hard "
                 "memory cap (cgroup)", metrics=[PEAK_RSS_ANON, OOM_KILLS],
                 arms=select([arm], opts.arms), settings={**settings, "root": os.geteuid() == 0},
                 baseline=None)


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest run (the harness suite's, or the earlier
    script's record)."""
    from ..render import harness_block, machine, newest

    path = newest(results, "memory_cap-2*.json", complete=True)
    if path is None:
        return "Not measured yet."
    doc = json.loads(path.read_text())
    if "summary" in doc:
        return harness_block(results, docs, "memory_cap", "python -m benchmarks run memory_cap")
    meta = machine({"provenance": doc["provenance"]})
    s = doc["provenance"]["settings"]
    return "\n".join([
        "| model (bf16) | cap | exit status | OOM kills | cgroup peak | peak RssAnon | wall |",
        "|---|---|---|---|---|---|---|",
        f"| {doc['model']['layers']} layers, {doc['model']['bf16_bytes'] / 2**20:.0f} MiB | "
        f"{doc['cap_bytes'] / 2**20:.0f} MiB | {doc['exit_status']} | {doc['cgroup']['oom_kill']} | "
        f"{doc['cgroup']['peak_usage_bytes'] / 2**20:.0f} MiB | "
        f"{doc['rss']['peak_rss_anon_bytes'] / 2**20:.0f} MiB | {doc['wall_seconds']:.0f} s |",
        "", f"Calibration {s['samples']} x {s['seqlen']} tokens. Machine: {meta['cpu']} "
        f"({meta['isa']}), {meta['cores']} cores; git {meta['sha'][:7]}; one run of the earlier "
        f"script. Command now: `python -m benchmarks run memory_cap`. Result file: "
        f"[{path.name}]({os.path.relpath(path, docs)})."])
