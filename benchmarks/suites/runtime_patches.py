"""Suite ``runtime_patches``: what the plugin's generic patches change at engine start.

One part per artifact, each its own result file ``runtime_patches-LABEL``: ``bf16`` (the source,
by default the demo model), ``gptq`` and ``int4`` (its ``gptq`` and ``cpu_int4`` checkpoints,
built data-free as the ``runtime`` suite builds them; ``--artifact LABEL=DIR`` serves DIR
instead). ``--arms`` takes labels. Arms, passes and metrics: ``benchmarks/runtime_patches_bench.py``
(its worker): the engine started twice per pass (cold, then warm compile cache), ``stock``
(no plugin) against ``patched`` (only this plugin), or on ``cpu_int4``, which stock vLLM cannot
load, ``patches-off`` (the plugin with its patches switched off) against ``patched``.

Smoke mode: the ``bf16`` part on the quantize suite's tiny random Llama.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import runtime_patches_bench as rp
from .. import tinygemm_bench as tb
from ..harness import HarnessError, Suite
from .quantize import SuiteOptions, source_model

LABELS = {"bf16": "bf16", "gptq": "gptq", "int4": "cpu_int4"}  # label -> runtime arm


def artifacts(opts: SuiteOptions) -> dict[str, Path]:
    prebuilt = {k: Path(v).resolve() for k, v in (opts.prebuilt or {}).items()}
    wanted = [a for a in opts.arms or LABELS if a in LABELS or a in prebuilt]
    unknown = sorted(set(opts.arms or []) - set(LABELS) - set(prebuilt))
    if unknown:
        raise HarnessError(f"unknown artifact label(s) {', '.join(unknown)}; known: "
                           f"{', '.join(LABELS)} and those given with --artifact")
    if opts.smoke and not opts.arms:
        wanted = ["bf16"]
    for label, path in prebuilt.items():
        if not (path / "config.json").is_file():
            raise HarnessError(f"--artifact {label}={path}: no config.json there")
    src = source_model(opts)
    build = [LABELS[a] for a in wanted if a not in prebuilt]
    inputs = opts.workdir / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    built = tb.build_artifacts(src.name, inputs, build, src)
    return {a: prebuilt[a] if a in prebuilt else built[LABELS[a]] for a in wanted}


def build(opts: SuiteOptions) -> list[Suite]:
    return [rp.build_suite(label, model) for label, model in artifacts(opts).items()]


# -- the results page ------------------------------------------------------------------------
METRICS = (("cold start", "cold_start_seconds"), ("warm start", "warm_start_seconds"),
           ("RssAnon after start-up", "rss_anon_after_start_bytes"))


def _cell(doc: dict, metric: str) -> str:
    patched = doc["comparisons"]["patched"][metric]
    if patched["verdict"].startswith("no difference"):
        return f"×{patched['ratio_median']:.3f} [{patched['ratio_min']:.3f}–" \
               f"{patched['ratio_max']:.3f}], no difference"
    return f"**×{patched['ratio_median']:.3f}** [{patched['ratio_min']:.3f}–" \
           f"{patched['ratio_max']:.3f}]"


def render(results: Path, docs: Path) -> str:
    """The results page's block: per artifact, the patched arm against its baseline (ratios
    per pass, median [range]), from the newest result file of each."""
    from ..render import machine, newest

    lines = ["| artifact | baseline | " + " | ".join(t for t, _ in METRICS)
             + " | passes | machine | git | result file |", "|" + "---|" * (len(METRICS) + 6)]
    for label in LABELS:
        path = newest(results, f"runtime_patches-{label}-2*.json", complete=True)
        if path is None:
            continue
        doc = json.loads(path.read_text())
        meta = machine(doc)
        lines.append(f"| {label} | `{doc['baseline']}` | "
                     + " | ".join(_cell(doc, m) for _, m in METRICS)
                     + f" | {doc['passes']} | {meta['cpu']} ({meta['isa']}) | {meta['sha'][:7]}"
                     f" | [{path.name}]({os.path.relpath(path, docs)}) |")
    return "\n".join(lines + [
        "", "Ratios: `patched` / baseline within a pass; bold where the harness finds a "
        "difference. Command: `python -m benchmarks run runtime_patches [--arms LABEL,...] "
        "[--artifact LABEL=DIR]`."])
