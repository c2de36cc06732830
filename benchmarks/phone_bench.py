"""Phone-CPU programs on this CPU: .pte size, export time and tokens/s through ExecuTorch's
Python runtime, for XNNPACK fp32 vs 8da8w vs 8da4w.

    python -m benchmarks.phone_bench [--src CKPT] [--passes 3] [--max-seq-len 128]
                                     [--prompt-tokens 64] [--gen-tokens 32] [--verify-windows 4]
                                     [--workdir DIR]

1. Export each arm once with ``cpu_quant.export.pipeline.export_phone`` (verification
   included), timing quantize+lower+write and verify separately (one pass each: an export of
   the demo model takes minutes, so export time is a single measurement and labelled so).
2. Decode speed: each pass runs every arm once, in rotated order (pass 0: A B C, pass 1: B C A,
   ...), each in its own subprocess (``--measure PTE``) that loads the program, prefills a fixed
   held-out prompt through ``prefill`` and greedily decodes ``--gen-tokens`` tokens through
   ``decode`` (the same host loop as verification). Reported per arm: median and spread
   (max - min) of prefill and decode tokens/s, and per-pass ratios against fp32.

Result: ``benchmarks/results/phone-<UTC time>.json`` with ``provenance.collect`` (git SHA,
packages, the .pte files' sha256, threads, CPU, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("fp32", "8da8w", "8da4w")
BASELINE = "fp32"


def measure(pte: Path, src: Path, max_seq_len: int, prefill_len: int, prompt_tokens: int,
            gen_tokens: int) -> dict:
    """One pass of one arm, in this process: prefill + greedy decode through the runtime."""
    import torch
    from transformers import AutoTokenizer

    from cpu_quant.data.corpus import builtin_split, token_windows
    from cpu_quant.export.model import read_spec
    from cpu_quant.export.runner import GraphShape, StaticKVRunner
    from cpu_quant.export.verify import pte_step_functions

    spec = read_spec(src)
    shape = GraphShape(spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.vocab_size,
                       max_seq_len, prefill_len)
    tok = AutoTokenizer.from_pretrained(src)
    prompt = token_windows(tok, builtin_split("heldout"), 1, prompt_tokens)[0]
    t = time.perf_counter()
    runner = StaticKVRunner(shape, *pte_step_functions(pte))
    load_s = time.perf_counter() - t
    runner.generate(prompt[:prefill_len], 2)  # warm-up: first-call allocations, XNNPACK setup
    runner.reset()
    t = time.perf_counter()
    logits = runner.prefill(prompt)
    prefill_s = time.perf_counter() - t
    token = int(torch.argmax(logits[-1]))
    t = time.perf_counter()
    for _ in range(gen_tokens):
        token = int(torch.argmax(runner.decode(token)))
    decode_s = time.perf_counter() - t
    return {"load_s": load_s, "prefill_tok_s": len(prompt) / prefill_s,
            "decode_tok_s": gen_tokens / decode_s, "threads": torch.get_num_threads()}


def _export(src: Path, out: Path, scheme: str, max_seq_len: int, prefill_len: int,
            verify_windows: int) -> dict:
    from cpu_quant.export.pipeline import PhoneExportSettings, export_phone

    if (out / "export_report.json").is_file():
        report = json.loads((out / "export_report.json").read_text())
        s = report["settings"]
        if (s["scheme"], s["max_seq_len"], s["prefill_len"], s["verify_windows"]) == (
                scheme, max_seq_len, prefill_len, verify_windows):
            return report
        raise SystemExit(f"{out} holds an export with other settings; remove it or use --workdir")
    settings = PhoneExportSettings(backend="xnnpack", scheme=scheme, max_seq_len=max_seq_len,
                                   prefill_len=prefill_len, verify_windows=verify_windows)
    t = time.perf_counter()
    report = export_phone(src, out, settings, progress=False)
    report["timings_s"]["wall"] = round(time.perf_counter() - t, 2)
    return report


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "spread": max(values) - min(values),
            "min": min(values), "max": max(values), "n": len(values), "values": values}


def run(args: argparse.Namespace) -> dict:
    from cpu_quant.models.demo import demo_model_path

    from .provenance import collect, validate

    src = Path(args.src) if args.src else demo_model_path()
    workdir = Path(args.workdir or RESULTS.parent / ".phone-work")
    workdir.mkdir(parents=True, exist_ok=True)
    prefill_len = min(args.prefill_len, args.max_seq_len)
    exports, ptes = {}, {}
    for arm in ARMS:
        out = workdir / f"{src.name}-{arm}-s{args.max_seq_len}"
        print(f"exporting {arm} -> {out}", file=sys.stderr)
        report = _export(src, out, arm, args.max_seq_len, prefill_len, args.verify_windows)
        ptes[arm] = out / "model.pte"
        exports[arm] = {"pte_bytes": report["sizes"]["pte_bytes"],
                        "ratio_vs_float32_params": report["sizes"]["ratio_vs_float32"],
                        "export_s": report["timings_s"], "verification": {
                            k: report["verification"][k] for k in
                            ("pte_vs_float", "pte_vs_quantized", "perplexity")}}
    fp32_bytes = exports[BASELINE]["pte_bytes"]
    for arm in ARMS:
        exports[arm]["size_vs_fp32_pte"] = round(exports[arm]["pte_bytes"] / fp32_bytes, 4)

    records, failures = [], []
    for p in range(args.passes):
        order = ARMS[p % len(ARMS):] + ARMS[:p % len(ARMS)]
        for arm in order:
            cmd = [sys.executable, "-m", "benchmarks.phone_bench", "--measure", str(ptes[arm]),
                   "--src", str(src), "--max-seq-len", str(args.max_seq_len),
                   "--prefill-len", str(prefill_len), "--prompt-tokens", str(args.prompt_tokens),
                   "--gen-tokens", str(args.gen_tokens)]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parent.parent)
            if proc.returncode != 0:
                failures.append({"pass": p, "arm": arm, "exit": proc.returncode,
                                 "stderr": proc.stderr[-3000:]})
                continue
            rec = json.loads(proc.stdout.strip().splitlines()[-1])
            records.append({"pass": p, "arm": arm, **rec})
            print(f"pass {p} {arm}: {rec}", file=sys.stderr)

    summary, ratios = {}, {}
    for arm in ARMS:
        mine = [r for r in records if r["arm"] == arm]
        summary[arm] = {m: _stats([r[m] for r in mine]) for m in ("prefill_tok_s", "decode_tok_s")
                        if mine}
        ratios[arm] = {}
        for m in ("prefill_tok_s", "decode_tok_s"):
            per_pass = []
            for p in range(args.passes):
                a = [r[m] for r in records if r["pass"] == p and r["arm"] == arm]
                b = [r[m] for r in records if r["pass"] == p and r["arm"] == BASELINE]
                if a and b:
                    per_pass.append(a[0] / b[0])
            if per_pass:
                ratios[arm][m] = _stats(per_pass)
    settings = {k: getattr(args, k) for k in ("passes", "max_seq_len", "prefill_len",
                                              "prompt_tokens", "gen_tokens", "verify_windows")}
    settings["source"] = str(src)
    prov = collect(settings, artifacts={f"{arm}.pte": ptes[arm] for arm in ARMS})
    validate(prov)
    import executorch.version
    import torchao

    prov["packages"].update(executorch=executorch.version.__version__,
                            torchao=torchao.__version__)
    return {"suite": "phone", "arms": list(ARMS), "baseline": BASELINE, "exports": exports,
            "records": records, "failures": failures, "summary": summary,
            "ratios_vs_fp32": ratios, "provenance": prov,
            "notes": ["export time: one export per arm (single measurement)",
                      "tokens/s: ExecuTorch Python runtime (pybindings), batch 1, greedy"]}


def print_table(result: dict) -> None:
    rows = ["| arm | .pte MiB | size vs fp32 | export s (quantize+lower+write / verify) | "
            "prefill tok/s (median, spread) | decode tok/s (median, spread) | decode vs fp32 |",
            "|---|---|---|---|---|---|---|"]
    for arm in result["arms"]:
        e, s = result["exports"][arm], result["summary"].get(arm, {})
        r = result["ratios_vs_fp32"].get(arm, {}).get("decode_tok_s")
        t = e["export_s"]

        def cell(m: str, s=s) -> str:
            return f"{s[m]['median']:.1f} ({s[m]['spread']:.1f})" if m in s else "failed"

        ratio = f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
        rows.append(f"| {arm} | {e['pte_bytes'] / 2**20:.1f} | {e['size_vs_fp32_pte']:.3f} | "
                    f"{t.get('quantize_and_lower', 0) + t.get('write', 0):.0f} / "
                    f"{t.get('verify', 0):.0f} | {cell('prefill_tok_s')} | "
                    f"{cell('decode_tok_s')} | {ratio} |")
    print("\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=None, help="checkpoint (default: the demo model)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--verify-windows", type=int, default=4,
                    help="held-out windows the export's own verification scores (the command's "
                         "default is 4; fewer only shortens the verify stage, reported apart)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        rec = measure(Path(args.measure), Path(args.src), args.max_seq_len, args.prefill_len,
                      args.prompt_tokens, args.gen_tokens)
        print(json.dumps(rec))
        return 0
    if args.passes < 3:
        print("warning: fewer than 3 passes is not a result (shared/MEASURING.md rule 5)",
              file=sys.stderr)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"phone-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    print_table(result)
    print(f"result: {path}", file=sys.stderr)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
