"""Suite ``kill_resume``: a quantization run killed at scripted points and resumed.

One arm, ``layers-8``: the worker ``benchmarks/kill_resume.py`` quantizes a random 8-layer model
(hidden 64) once uninterrupted, then once per kill point (an event of the run and a signal:
SIGKILL, SIGINT or SIGTERM, some with ``--offload-activations``), resumes each and compares the
resumed artifact's tensors with the uninterrupted run's. Each point ends ``identical``,
``refused`` (one ``error:`` line, no traceback), ``finished`` (the signal came during the last
write and the run completed with the same tensors) or ``FAILED``. Metrics: ``failed_points``
(must be 0) and ``stop_seconds_max``, the longest time from a SIGINT or SIGTERM to the run's
exit. Extras: the outcome counts and every point's record.

Smoke mode: 4 layers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..harness import Arm, Command, Metric, PassContext, RunRecord, Suite
from .quantize import TIMEOUT_REAL, SuiteOptions, select

FAILED_POINTS = Metric("failed_points", "points", "lower", ratio=False)
STOP_SECONDS = Metric("stop_seconds_max", "s", "lower")
OUTCOMES = ("identical", "refused", "finished", "FAILED")


def build(opts: SuiteOptions) -> Suite:
    layers = 4 if opts.smoke else 8

    def command(ctx: PassContext) -> Command:
        return Command([sys.executable, "-m", "benchmarks.kill_resume", "--layers", str(layers),
                        "--work", str(ctx.workdir / "work"), "--json",
                        str(ctx.workdir / "kill_resume.json")], timeout=TIMEOUT_REAL)

    def read(ctx: PassContext) -> dict:
        return json.loads((ctx.workdir / "kill_resume.json").read_text())

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        doc = read(ctx)
        return {"failed_points": float(doc["outcomes"]["FAILED"]),
                "stop_seconds_max": float(doc["stop_seconds"]["max"] or 0.0)}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        doc = read(ctx)
        return {k: doc[k] for k in ("outcomes", "stop_seconds", "uninterrupted", "points")}

    arm = Arm(f"layers-{layers}", {"layers": layers}, command, collect, extras=extras)
    return Suite(name="kill_resume", description="a quantization run killed at scripted points "
                 "and resumed, against an uninterrupted run", metrics=[FAILED_POINTS, STOP_SECONDS],
                 arms=select([arm], opts.arms), settings={"layers": layers}, baseline=None)


def _row(doc: dict, passes: str, git: str, path: Path, docs: Path) -> str:
    counts = doc["outcomes"]
    stop = doc["stop_seconds"]
    return (f"| {len(doc['points'])} | " + " | ".join(str(counts[o]) for o in OUTCOMES)
            + f" | {stop['median']} / {stop['max']} s | {passes} | {git} | "
            f"[{path.name}]({os.path.relpath(path, docs)}) |")


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest run's outcomes (this suite's result file, whose
    passes each ran every point, or the earlier script's record)."""
    from ..render import machine, newest

    suite = newest(results, "kill_resume-2*.json", complete=True)
    legacy = sorted(p for p in results.glob("kill-resume-2*.json")
                    if "stop_seconds" in json.loads(p.read_text()))
    lines = ["| kill points | " + " | ".join(OUTCOMES) + " | SIGINT/SIGTERM to exit: median / "
             "max | passes | git | result file |", "|" + "---|" * (len(OUTCOMES) + 5)]
    if suite is not None:
        doc = json.loads(suite.read_text())
        ok = [r for r in doc["records"] if r["ok"]]
        meta = machine(doc)
        lines.append(_row(ok[-1]["extras"], f"{len(ok)} of {len(doc['records'])}",
                          meta["sha"][:7], suite, docs))
    elif legacy:
        doc = json.loads(legacy[-1].read_text())
        meta = machine({"provenance": doc["provenance"]})
        lines.append(_row(doc, "1 (the earlier script)", meta["sha"][:7], legacy[-1], docs))
    else:
        return "Not measured yet."
    return "\n".join(lines + ["", f"Machine: {meta['cpu']} ({meta['isa']}), {meta['cores']} "
                              "cores. Command: `python -m benchmarks run kill_resume`."])
