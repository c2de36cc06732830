"""Suite ``eval_set``: artifacts built elsewhere, scored side by side by one evaluator.

For a comparison whose artifacts the real commands built (other revisions, other settings):
``python -m benchmarks run eval_set --artifact NAME=DIR [--artifact ...] [--source SRC]``. Each
``--artifact`` is an arm; every pass runs ``cpu-quant eval DIR --reference SRC`` with the
``fidelity`` suite's evaluation and metrics (held-out split, bf16 and W4A8-emulated
activations), and records the digest of the weights it scored. No baseline: the arms are
whatever was given. Smoke mode: the fidelity suite's smoke evaluation.
"""

from __future__ import annotations

from pathlib import Path

from ..harness import Arm, HarnessError, Suite
from . import fidelity
from . import quantize as q


def make_arm(name: str, artifact: Path, src: Path, ev: dict, timeout: float) -> Arm:
    artifact_of = fidelity.artifact_resolver(artifact)
    return Arm(name, {"artifact": str(artifact), "eval": ev},
               fidelity.eval_command(src, ev, timeout, artifact_of, lambda path: None),
               fidelity.collect_eval, artifacts=lambda ctx: {"artifact": artifact},
               extras=fidelity.eval_extras(src, artifact_of))


def build(opts: q.SuiteOptions) -> Suite:
    if not opts.prebuilt:
        raise HarnessError("eval_set scores the artifacts given with --artifact NAME=DIR")
    src = q.source_model(opts)
    ev = dict(fidelity.EVAL_SMOKE if opts.smoke else fidelity.EVAL_REAL)
    timeout = q.TIMEOUT_SMOKE if opts.smoke else q.TIMEOUT_REAL
    arms = [make_arm(name, Path(path).resolve(), src, ev, timeout)
            for name, path in opts.prebuilt.items()]
    return Suite(name="eval_set", description="artifacts built elsewhere, scored by cpu-quant "
                 "eval against one source", metrics=fidelity.METRICS,
                 arms=q.select(arms, opts.arms), settings={"source": str(src), "eval": ev},
                 baseline=None, inputs={"source": src})


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest run of this suite, or the earlier script's newest
    set (its arms' KL with its standard error, on the text each was scored on)."""
    import json
    import os

    from ..render import harness_block, machine, newest

    if newest(results, "eval_set-2*.json", complete=True) is not None:
        return harness_block(results, docs, "eval_set",
                             "python -m benchmarks run eval_set --artifact NAME=DIR ...")
    found = sorted(results.glob("eval-set-*.json"), key=lambda p: p.name.split("-")[-1])
    if not found:
        return "Not measured yet."
    path = found[-1]
    doc = json.loads(path.read_text())
    meta = machine({"provenance": doc["provenance"]})
    lines = ["| arm | text | KL (nats) ± se | ppl Δ | top-1 | greedy prefix |",
             "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        text = r["text"] if r["text"].startswith("built-in") else f"`{Path(r['text']).name}`"
        lines.append(f"| `{r['arm']}` | {text} | {r['kl_mean']:.4f} ± {r['kl_stderr']:.4f} | "
                     f"{r['ppl_delta']:+.3f} | {r['top1_agreement']:.3f} | "
                     f"{r['greedy_prefix_fraction']:.3f} |")
    return "\n".join(lines + ["", " ".join(doc["notes"]), "",
                              f"Machine: {meta['cpu']} ({meta['isa']}); git {meta['sha'][:7]}; "
                              "gathered by the earlier script. Command now: `python -m benchmarks "
                              "run eval_set --artifact NAME=DIR ...`. Result file: "
                              f"[{path.name}]({os.path.relpath(path, docs)})."])
