"""The ``moe`` suite's worker: quantize a tiny Qwen3-MoE to GGUF, or score that GGUF's weights.

    python -m benchmarks.moe_fidelity model --out DIR [--smoke]
    python -m benchmarks.moe_fidelity quantize --src SRC --out DIR --samples N --seqlen L
                                               [--expert-min-tokens T]
    python -m benchmarks.moe_fidelity eval --src SRC --artifact DIR --windows W --seqlen L
                                           --json OUT

``model`` writes the suite's seeded model (``cpu_quant.models.tiny.QWEN3_MOE``'s ratios, weights
drawn with std ``1/sqrt(hidden)`` as the ``fidelity_archs`` suite's). ``quantize`` runs
``cpu-quant gptq --format gguf`` in process (``QuantSettings.expert_min_tokens`` has no
command-line option; a huge value sends every expert to the round-to-nearest fallback). ``eval``
holds the source model with the GGUF's Q4_0 linears dequantized (``gguf.reader.unpack``: every
quantized tensor as llama.cpp reads it; the embedding stays the source's bf16, the same in every
arm) against the bf16 source on the built-in corpus' held-out split: mean KL(source ||
quantized) over the scored tokens and top-1 agreement, with the experts' record of the
artifact's report.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from cpu_quant.core.io.checkpoint import load_tokenizer
from cpu_quant.data.corpus import load_texts, token_windows
from cpu_quant.eval.dequantized import load_model
from cpu_quant.formats import get_format
from cpu_quant.formats.gguf.reader import unpack
from cpu_quant.models.demo import demo_model_path
from cpu_quant.models.tiny import QWEN3_MOE, make_tiny_model
from cpu_quant.quantize.pipeline import quantize_checkpoint
from cpu_quant.quantize.settings import QuantSettings

SEED = 0
SHAPE = replace(QWEN3_MOE, init_std=1 / math.sqrt(QWEN3_MOE.hidden))
SMOKE_SHAPE = replace(SHAPE, layers=1, experts=8)


def cmd_model(args: argparse.Namespace) -> None:
    make_tiny_model("qwen3_moe", args.out, demo_model_path(), seed=SEED,
                    shape=SMOKE_SHAPE if args.smoke else SHAPE)


def cmd_quantize(args: argparse.Namespace) -> None:
    settings = QuantSettings(samples=args.samples, seqlen=args.seqlen,
                             expert_min_tokens=args.expert_min_tokens)
    quantize_checkpoint(args.src, args.out, settings, [get_format("gguf")], progress=False)


@torch.no_grad()
def cmd_eval(args: argparse.Namespace) -> None:
    src, artifact = Path(args.src), Path(args.artifact)
    gguf_file = next(artifact.glob("*.gguf"))
    report = json.loads(next(artifact.glob("*.quantization_report.json")).read_text())
    windows = token_windows(load_tokenizer(src), load_texts(None, "heldout"), args.windows,
                            args.seqlen)
    ids = torch.tensor(windows, dtype=torch.long)
    reference = load_model(src, dtype=torch.float32)
    ref_logp = torch.cat([torch.log_softmax(reference(w[None]).logits[0].double(), -1)
                          for w in ids])
    del reference
    model = load_model(src, dtype=torch.float32)
    modules = dict(model.named_modules())
    written = unpack(gguf_file)
    for name, gq in written.items():
        modules[name].weight.data = gq.dequantize().float()
    logp = torch.cat([torch.log_softmax(model(w[None]).logits[0].double(), -1) for w in ids])
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    top1 = (ref_logp.argmax(-1) == logp.argmax(-1)).double().mean()
    experts = report["experts"]
    doc = {"kl_mean": kl.mean().item(), "kl_stderr": (kl.std() / math.sqrt(kl.numel())).item(),
           "top1": top1.item(), "tokens": kl.numel(), "quantized_modules": len(written),
           "experts": experts["experts"], "experts_fallback": experts["experts_fallback"],
           "fallback_share": experts["fallback_share"],
           "calibration_tokens": report["calibration_tokens"],
           "quantize_seconds": report["total_seconds"]}
    Path(args.json).write_text(json.dumps(doc, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.moe_fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--smoke", action="store_true")
    q = sub.add_parser("quantize")
    q.add_argument("--src", type=Path, required=True)
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("--samples", type=int, required=True)
    q.add_argument("--seqlen", type=int, required=True)
    q.add_argument("--expert-min-tokens", type=int, default=None)
    e = sub.add_parser("eval")
    e.add_argument("--src", type=Path, required=True)
    e.add_argument("--artifact", type=Path, required=True)
    e.add_argument("--windows", type=int, required=True)
    e.add_argument("--seqlen", type=int, required=True)
    e.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    {"model": cmd_model, "quantize": cmd_quantize, "eval": cmd_eval}[args.cmd](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
