"""Phone programs on this CPU: .pte size, export time and tokens/s through ExecuTorch's
Python runtime, for XNNPACK fp32 vs 8da8w vs 8da4w, and QNN's w8a16 and 16a4w programs on
ExecuTorch's portable kernels (without the Qualcomm SDK: not the HTP).

    python -m benchmarks.phone_bench [--src CKPT] [--passes 3] [--smoke] [--arms A,B]
                                     [--max-seq-len 128] [--prefill-len 64] [--prompt-tokens 64]
                                     [--gen-tokens 32] [--verify-windows 4] [--workdir DIR]
                                     [--out DIR]

The same measurement as ``python -m benchmarks run phone`` (the harness suite
``benchmarks/suites/phone.py``: arms interleaved with the order rotated every pass, >= 3 passes
unless ``--smoke``, median and spread, per-pass ratios against fp32, failures recorded,
provenance), with the export and runtime sizes as flags. This module also holds the two
subprocess steps the suite runs:

``--export OUT --scheme S``   one export with ``cpu_quant.export.pipeline.export_phone``
                              (the scheme's backend, verification included) into OUT: the arm's one-off build,
                              whose wall time and peak RssAnon the harness records
``--measure PTE --record F``  one pass: load the program, prefill a fixed held-out prompt
                              through ``prefill`` and greedily decode ``--gen-tokens`` tokens
                              through ``decode`` (the same host loop as verification); writes
                              tokens/s to F (stdout without ``--record``)

Result: ``benchmarks/results/phone[-smoke]-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .suites.phone import ARM_SETTINGS, ARMS, BACKEND, SCHEME

RESULTS = Path(__file__).resolve().parent / "results"


def measure(pte: Path, src: Path, max_seq_len: int, prefill_len: int, prompt_tokens: int,
            gen_tokens: int) -> dict:
    """One pass of one arm, in this process: prefill + greedy decode through the runtime."""
    import torch
    from transformers import AutoTokenizer

    from cpu_quant.data.corpus import builtin_split, token_windows
    from cpu_quant.export.graph import GraphShape
    from cpu_quant.export.model import read_spec
    from cpu_quant.export.runner import StaticKVRunner
    from cpu_quant.export.verify import pte_step_functions

    spec = read_spec(src)
    shape = GraphShape(spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.vocab_size,
                       max_seq_len, prefill_len)
    tok = AutoTokenizer.from_pretrained(src)
    prompt = token_windows(tok, builtin_split("heldout"), 1, prompt_tokens)[0]
    t = time.perf_counter()
    runner = StaticKVRunner(shape, *pte_step_functions(pte, shape))
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
            "decode_tok_s": gen_tokens / decode_s, "prompt_tokens": len(prompt),
            "gen_tokens": gen_tokens, "max_seq_len": max_seq_len, "prefill_len": prefill_len,
            "threads": _executorch_threads()}


def _executorch_threads() -> int:
    """The ExecuTorch thread pool's size (what runs the program; torch's own pool does not)."""
    from executorch.extension.pybindings import portable_lib

    return portable_lib._threadpool_get_thread_count()


def export(src: Path, out: Path, arm: str, max_seq_len: int, prefill_len: int,
           verify_windows: int, gptq: dict | None = None) -> dict:
    """One export of ``src`` into ``out`` (replaced) for ``arm`` (its scheme and settings),
    verification included; ``gptq``: the GPTQ run's calibration (``gptq_samples``,
    ``gptq_seqlen``) for the 4-bit schemes."""
    from cpu_quant.export.pipeline import PhoneExportSettings, export_phone

    settings = PhoneExportSettings(backend=BACKEND[arm], scheme=SCHEME[arm],
                                   max_seq_len=max_seq_len,
                                   prefill_len=min(prefill_len, max_seq_len),
                                   verify_windows=verify_windows, **(gptq or {}),
                                   **ARM_SETTINGS.get(arm, {}))
    return export_phone(src, out, settings, overwrite=True, progress=False)


def main(argv: list[str] | None = None) -> int:
    from .suites import phone

    real = phone.REAL
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--src", default=None,
                    help="checkpoint (default: the demo model; --smoke: a tiny random Llama)")
    ap.add_argument("--passes", type=int, default=None, help="default 3 (1 with --smoke)")
    ap.add_argument("--smoke", action="store_true",
                    help="the suite's smoke settings (tiny model, one pass, no verdicts)")
    ap.add_argument("--arms", default=None, help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help=f"static KV-cache length (default {real['max_seq_len']})")
    ap.add_argument("--prefill-len", type=int, default=None,
                    help=f"tokens per prefill call (default {real['prefill_len']})")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help=f"prompt prefilled per pass (default {real['prompt_tokens']})")
    ap.add_argument("--gen-tokens", type=int, default=None,
                    help=f"tokens decoded per pass (default {real['gen_tokens']})")
    ap.add_argument("--verify-windows", type=int, default=None,
                    help="held-out windows the export's own verification scores (default "
                         f"{real['verify_windows']}; fewer only shortens the verify stage)")
    ap.add_argument("--gptq-samples", type=int, default=None,
                    help="calibration windows of the 4-bit schemes' GPTQ run (default "
                         f"{real['gptq_samples']})")
    ap.add_argument("--gptq-seqlen", type=int, default=None,
                    help=f"tokens per GPTQ calibration window (default {real['gptq_seqlen']})")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--export", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--scheme", default=None, choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = {k: getattr(args, k) for k in real if getattr(args, k, None) is not None}
    if args.export or args.measure:
        if args.src is None:
            ap.error("--export and --measure need --src")
        s = {**real, **sizes}
        if args.export:
            if args.scheme is None:
                ap.error("--export needs --scheme")
            export(Path(args.src), Path(args.export), args.scheme, s["max_seq_len"],
                   s["prefill_len"], s["verify_windows"],
                   {"gptq_samples": s["gptq_samples"], "gptq_seqlen": s["gptq_seqlen"]})
            return 0
        rec = measure(Path(args.measure), Path(args.src), s["max_seq_len"], s["prefill_len"],
                      s["prompt_tokens"], s["gen_tokens"])
        if args.record:
            Path(args.record).write_text(json.dumps(rec) + "\n")
        else:
            print(json.dumps(rec))
        return 0
    return phone.run_from_cli(smoke=args.smoke, passes=args.passes,
                              src=Path(args.src).resolve() if args.src else None,
                              arms=args.arms.split(",") if args.arms else None,
                              sizes=sizes, out=Path(args.out),
                              workdir=Path(args.workdir).resolve() if args.workdir else None)


if __name__ == "__main__":
    sys.exit(main())
