"""Suite ``tinygemm_fidelity``: the fidelity behind two ``cpu_int4`` choices, the asymmetric
grid and a bf16 input embedding.

Arms, each built once and scored every pass by ``cpu-quant eval`` against the bf16 source on
the held-out split, as the ``fidelity`` suite scores its arms (its metrics, evaluation and
checks):

``asym``         ``cpu-quant tinygemm`` (asymmetric grid, the default), embedding bf16
``sym``          ``cpu-quant tinygemm --sym``: the symmetric grid, same calibration and groups
``asym_shared``  ``asym`` with its input embedding replaced by its 4-bit head dequantized to
                 bf16 (the build worker ``benchmarks/tinygemm_fidelity.py``)

Baseline ``asym``. Calibration 128 x 512 tokens (smoke: 4 x 64), evaluation the fidelity
suite's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..harness import Command, Suite
from . import fidelity
from . import quantize as q

ARMS = (fidelity.FidelityArm("asym", "tinygemm cpu_int4, asymmetric, embedding bf16",
                             "cpu-quant", subcommand="tinygemm"),
        fidelity.FidelityArm("sym", "tinygemm cpu_int4, symmetric", "cpu-quant",
                             subcommand="tinygemm", flags=("--sym",)),
        fidelity.FidelityArm("asym_shared", "asym, the embedding its dequantized 4-bit head",
                             "cpu-quant", subcommand="tinygemm"))


def build(opts: q.SuiteOptions) -> Suite:
    src = q.source_model(opts)
    settings = dict(q.SMOKE if opts.smoke else q.REAL)
    ev = dict(fidelity.EVAL_SMOKE if opts.smoke else fidelity.EVAL_REAL)
    timeout = q.TIMEOUT_SMOKE if opts.smoke else q.TIMEOUT_REAL
    arms = {spec.name: fidelity.cpu_quant_fidelity_arm(spec, src, settings, ev, timeout)
            for spec in ARMS}

    def shared_build(bdir: Path) -> Command:
        argv = q.cpu_quant_gptq_argv(src, bdir / "artifact.asym", settings, [])
        argv[len(q.CLI)] = "tinygemm"
        return Command([sys.executable, "-m", "benchmarks.tinygemm_fidelity",
                        str(bdir / "artifact"), "--", *argv[len(q.CLI):]], timeout=timeout)

    arms["asym_shared"].build = shared_build
    arms["asym_shared"].settings["embedding"] = "the head's 4-bit codes, dequantized to bf16"
    return Suite(name="tinygemm_fidelity", description="cpu_int4: asymmetric against symmetric "
                 "grid, and a bf16 embedding against one sharing the 4-bit head",
                 metrics=fidelity.METRICS, arms=q.select(list(arms.values()), opts.arms),
                 settings={"source": str(src), **settings, "eval": ev}, baseline="asym",
                 inputs={"source": src})


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest run's table, or the earlier script's record."""
    import json
    import os

    from ..render import harness_block, machine, newest

    if newest(results, "tinygemm_fidelity-2*.json", complete=True) is not None:
        return harness_block(results, docs, "tinygemm_fidelity",
                             "python -m benchmarks run tinygemm_fidelity")
    found = sorted(results.glob("tinygemm-fidelity-2*.json"))
    if not found:
        return "Not measured yet."
    path = found[-1]
    doc = json.loads(path.read_text())
    meta = machine({"provenance": doc["provenance"]})
    s = doc["provenance"]["settings"]
    lines = ["| arm | KL (nats) | top-1 | ppl Δ | tokens |", "|---|---|---|---|---|"]
    for arm, r in doc["reports"].items():
        lines.append(f"| `{arm}` | {r['kl_mean']:.4f} | {r['top1_agreement']:.3f} | "
                     f"{r['ppl_delta']:+.2f} | {r['tokens']} |")
    return "\n".join(lines + [
        "", f"Evaluation: {s['windows']} windows x {s['seqlen']} tokens, {s['dtype']}. Machine: "
        f"{meta['cpu']} ({meta['isa']}), {meta['cores']} cores; git {meta['sha'][:7]}; one run "
        "of the earlier script. Command now: `python -m benchmarks run tinygemm_fidelity`. "
        f"Result file: [{path.name}]({os.path.relpath(path, docs)})."])
