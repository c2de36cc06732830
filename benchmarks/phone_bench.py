"""The pass workers of the ``phone`` suite (``benchmarks/suites/phone.py``): one export, or one
measurement of an exported program, through ExecuTorch's Python runtime.

    python -m benchmarks.phone_bench export --src CKPT --out DIR --scheme ARM [SIZES]
    python -m benchmarks.phone_bench measure --src CKPT --pte PTE --record F [SIZES]

``export``   one export with ``cpu_quant.export.pipeline.export_phone`` (the scheme's backend,
             verification included) into DIR: the arm's one-off build, whose wall time and peak
             RssAnon the harness records
``measure``  one pass: load the program, prefill a fixed held-out prompt through ``prefill``
             and greedily decode ``--gen-tokens`` tokens through ``decode`` (the same host loop
             as verification); writes tokens/s to F

SIZES are the suite's settings as flags (``--max-seq-len``, ``--prefill-len``,
``--prompt-tokens``, ``--gen-tokens``, ``--verify-windows``, ``--gptq-samples``,
``--gptq-seqlen``), all required: the suite passes every one.
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


SIZES = ("max_seq_len", "prefill_len", "prompt_tokens", "gen_tokens", "verify_windows",
         "gptq_samples", "gptq_seqlen")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.phone_bench",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = ap.add_subparsers(dest="step", required=True)
    exp = sub.add_parser("export")
    exp.add_argument("--out", type=Path, required=True)
    exp.add_argument("--scheme", choices=ARMS, required=True)
    mea = sub.add_parser("measure")
    mea.add_argument("--pte", type=Path, required=True)
    mea.add_argument("--record", type=Path, required=True)
    for p in (exp, mea):
        p.add_argument("--src", type=Path, required=True)
        for key in SIZES:
            p.add_argument(f"--{key.replace('_', '-')}", type=int, required=True)
    args = ap.parse_args(argv)
    if args.step == "export":
        export(args.src, args.out, args.scheme, args.max_seq_len, args.prefill_len,
               args.verify_windows,
               {"gptq_samples": args.gptq_samples, "gptq_seqlen": args.gptq_seqlen})
        return 0
    rec = measure(args.pte, args.src, args.max_seq_len, args.prefill_len, args.prompt_tokens,
                  args.gen_tokens)
    args.record.write_text(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
