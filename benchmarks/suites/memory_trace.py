"""Suite ``memory_trace``: where the peak RssAnon of a quantization run comes from.

A diagnostic. Each pass runs ``cpu-quant gptq``'s pipeline in one process (the worker
``benchmarks/memory_trace.py``) while a thread samples its RssAnon every 20 ms and records, at
each new maximum, the Python stacks of every thread and glibc's heap state. Arms:

``depth-1x``, ``depth-4x``      the memory suite's synthetic model at 1x and 4x the demo
                                model's 30 layers, the memory suite's settings (8 x 512 tokens)
``demo-default``, ``demo-plain``  the demo model at 128 x 512 tokens, built as the fidelity
                                suite's ``gptq+head`` (the default) and ``gptq+head-plain`` arms

Metrics: the tree's peak RssAnon (the harness's) and the traced peak (``traced_peak_bytes``).
Extras: the innermost frames of the main thread at the peak, and the heap state there.

Smoke mode: ``depth-1x`` at the smoke shapes (hidden 64), 4 x 64 tokens.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..harness import PEAK_RSS_ANON, Arm, Command, Metric, PassContext, RunRecord, Suite
from .quantize import TIMEOUT_REAL, TIMEOUT_SMOKE, SuiteOptions, select

TRACED_PEAK = Metric("traced_peak_bytes", "B", "lower")
ARMS = {"depth-1x": ["--depth", "1"], "depth-4x": ["--depth", "4"],
        "demo-default": ["--model", "demo", "--build", "default"],
        "demo-plain": ["--model", "demo", "--build", "plain"]}
SMOKE_FLAGS = ["--smoke", "--samples", "4", "--seqlen", "64", "--batch-size", "4"]
FRAMES = 3  # innermost frames of the main thread kept


def _arm(name: str, flags: list[str], workdir: Path, smoke: bool) -> Arm:
    def command(ctx: PassContext) -> Command:
        return Command([sys.executable, "-m", "benchmarks.memory_trace", *flags,
                        *(SMOKE_FLAGS if smoke else []), "--workdir", str(workdir),
                        "--json", str(ctx.workdir / "trace.json")],
                       timeout=TIMEOUT_SMOKE if smoke else TIMEOUT_REAL)

    def read(ctx: PassContext) -> dict:
        return json.loads((ctx.workdir / "trace.json").read_text())

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        return {"traced_peak_bytes": float(read(ctx)["peak_rss_anon_mib"] << 20)}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        doc = read(ctx)
        last = doc["peaks"][-1]
        return {"label": doc["label"], "layers": doc["layers"], "peak_at_s": last["t"],
                "main_thread_at_peak": last["stacks"].get("MainThread", [])[-FRAMES:],
                "malloc_at_peak": last["malloc"], "total_seconds": doc["total_seconds"]}

    return Arm(name, {"flags": flags, "smoke": smoke}, command, collect, extras=extras)


def build(opts: SuiteOptions) -> Suite:
    arms = {"depth-1x": ARMS["depth-1x"]} if opts.smoke else ARMS
    work = opts.workdir / "inputs"
    return Suite(name="memory_trace", description="where a quantization run's peak RssAnon "
                 "comes from (stacks and heap state at each new peak)",
                 metrics=[PEAK_RSS_ANON, TRACED_PEAK],
                 arms=select([_arm(n, f, work, opts.smoke) for n, f in arms.items()], opts.arms),
                 settings={"interval_s": 0.02}, baseline=None)


def _where(frames: list[str]) -> str:
    return " ← ".join(f"`{f}`" for f in reversed(frames[-2:]))


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest run of this suite, or the earlier script's
    newest trace of each build."""
    from ..render import harness_block, machine, newest

    if newest(results, "memory_trace-2*.json", complete=True) is not None:
        return harness_block(results, docs, "memory_trace", "python -m benchmarks run memory_trace",
                             {"at the peak (innermost first)":
                              lambda arm, doc: _where(next(
                                  r["extras"]["main_thread_at_peak"] for r in doc["records"]
                                  if r["arm"] == arm and r["ok"]))})
    newest_of: dict[str, Path] = {}
    for path in sorted(results.glob("memory-trace-*.json")):
        doc = json.loads(path.read_text())
        if "peaks" in doc and "provenance" in doc:
            newest_of[path.name.rsplit("-", 1)[0].removeprefix("memory-trace-")] = path
    lines = ["| build | layers | peak RssAnon | at the peak (innermost first) | machine | git | "
             "result file |", "|---|---|---|---|---|---|---|"]
    earlier, commands = [], []
    for label, path in sorted(newest_of.items()):
        doc = json.loads(path.read_text())
        meta = machine({"provenance": doc["provenance"]})
        if "json" in doc["provenance"]["settings"]:  # this script's run, outside the suite
            args = doc["command"].split()[1:]
            for flag in ("--workdir", "--json"):  # this machine's paths
                if flag in args:
                    del args[args.index(flag):args.index(flag) + 2]
            commands.append(f"{label}: `python -m benchmarks.memory_trace {' '.join(args)} "
                            "--json OUT`")
        else:
            earlier.append(label)
        frames = doc["peaks"][-1]["stacks"].get("MainThread", [])
        lines.append(f"| {label} | {doc['layers']} | {doc['peak_rss_anon_mib']} MiB | "
                     f"{_where(frames)} | {meta['cpu']} ({meta['isa']}) | {meta['sha'][:7]} | "
                     f"[{path.name}]({os.path.relpath(path, docs)}) |")
    foot = [f"One run each. {', '.join(earlier)}: of the earlier script; command now: "
            "`python -m benchmarks run memory_trace`."] if earlier else []
    return "\n".join(lines + [""] + foot + [f"{c}." for c in commands])
