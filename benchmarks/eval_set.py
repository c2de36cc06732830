"""Several ``cpu-quant eval --output-json`` summaries gathered into one result file.

    python -m benchmarks.eval_set --label NAME --arm ARM=EVAL.json [--arm ...] [--note TEXT]
                                  [--out DIR]

For a comparison whose artifacts were built and evaluated by the real commands (their command
lines go in ``--note``): each arm's KL mean and standard error, perplexity delta, top-1
agreement and greedy prefix fraction, with the text it was scored on and the artifact's
weight digest (``provenance.artifact_digest`` of the evaluated directory). Result file:
``<out>/eval-set-<label>-<UTC time>.json`` (atomic), with the benchmark provenance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import provenance
from .harness import write_result

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("kl_mean", "kl_stderr", "ppl_delta", "ppl_delta_stderr", "top1_agreement",
        "greedy_prefix_fraction", "tokens")


def arm_row(name: str, path: Path) -> dict:
    doc = json.loads(path.read_text())
    w = doc["fidelity"]["weights"]
    return {"arm": name, "eval_json": path.name, "quantized": doc["quantized"],
            "text": doc["settings"].get("text") or "built-in held-out split",
            **{k: w.get(k) for k in KEYS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.eval_set", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True)
    ap.add_argument("--arm", action="append", required=True, metavar="ARM=EVAL.json")
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows, artifacts = [], {}
    for spec in args.arm:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            print(f"error: --arm wants ARM=EVAL.json with an existing file, got {spec!r}",
                  file=sys.stderr)
            return 2
        row = arm_row(name, Path(path))
        rows.append(row)
        quantized = Path(path).parent / row["quantized"]
        if quantized.is_dir():
            artifacts[name] = quantized
    prov = provenance.collect({"label": args.label}, artifacts)
    provenance.validate(prov)
    doc = {"suite": "eval-set", "label": args.label, "notes": args.note, "rows": rows,
           "provenance": prov}
    path = write_result(args.out, f"eval-set-{args.label}", doc)
    for r in rows:
        print(f"{r['arm']}: KL {r['kl_mean']:.4f} ± {r['kl_stderr']:.4f} on {r['text']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
