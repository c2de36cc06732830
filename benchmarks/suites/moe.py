"""Suite ``moe``: per-expert GPTQ against round-to-nearest of the experts, on a tiny Qwen3-MoE.

The model: ``cpu_quant.models.tiny.QWEN3_MOE`` (Qwen3-30B-A3B's ratios: 32 experts of
intermediate 96, 2 per token, hidden 256, 8 query heads over 1 KV head, untied head; 2 layers),
seed 0, weights drawn with std ``1/sqrt(hidden)`` (the ``fidelity_archs`` suite's rule: at
transformers' 0.02 the logits are nearly uniform and quantization barely moves them). Random
weights: the numbers rank the experts' methods on this layout, not their gain on a trained
model.

Arms, each a GGUF (Q4_0) written once by the in-process quantizer (the arm's build,
``benchmarks/moe_fidelity.py quantize``) and scored every pass (``eval``):

=================  ==============================================================================
``experts-rtn``    every expert by round-to-nearest with the weighted scale search (the fallback,
                   forced: ``QuantSettings.expert_min_tokens`` above any count); attention and
                   head GPTQ. Calibration 32 x 512 tokens. The baseline.
``gptq``           the default: each expert GPTQ on its routed tokens, an expert with fewer tokens
                   than its hidden size falls back. 32 x 512 tokens (about 1024 per expert).
``gptq-short``     the default on 4 x 512 tokens (about 128 per expert, below the 256 needed:
                   most experts fall back)
=================  ==============================================================================

Metrics: ``kl_mean``, KL(bf16 source || quantized) in nats on 8 held-out windows x 512 tokens
of the built-in corpus, and top-1 agreement; extras: the share of experts that fell back, the
KL's standard error over the scored tokens, the calibration tokens. The evaluation is
deterministic: every pass of an arm gives the same numbers.

Smoke mode (CI): 1 layer of 8 experts, calibration 4 x 64, evaluation 2 x 64.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..harness import Arm, Command, Metric, PassContext, RunRecord, Suite
from ..render import harness_block
from .quantize import TIMEOUT_REAL, TIMEOUT_SMOKE, SuiteOptions, select

KL = Metric("kl_mean", "nats", "lower")
TOP1 = Metric("top1", "", "higher")
WORKER = [sys.executable, "-m", "benchmarks.moe_fidelity"]
ALL_EXPERTS_RTN = 1 << 40  # more tokens than any calibration routes to an expert
REAL = {"samples": 32, "short": 4, "seqlen": 512, "eval_windows": 8, "eval_seqlen": 512}
SMOKE = {"samples": 4, "short": 2, "seqlen": 64, "eval_windows": 2, "eval_seqlen": 64}
ARMS = ("experts-rtn", "gptq", "gptq-short")


def build(opts: SuiteOptions) -> Suite:
    import subprocess

    if opts.source is not None or opts.prebuilt:
        raise ValueError("moe builds its own tiny model: no --source or --artifact")
    sizes = SMOKE if opts.smoke else REAL
    timeout = TIMEOUT_SMOKE if opts.smoke else TIMEOUT_REAL
    src = opts.workdir / "inputs" / "tiny-qwen3-moe"
    if not (src / "config.json").is_file():
        subprocess.run([*WORKER, "model", "--out", str(src), *(["--smoke"] if opts.smoke else [])],
                       check=True)
    runs = {"experts-rtn": (sizes["samples"], ALL_EXPERTS_RTN),
            "gptq": (sizes["samples"], None), "gptq-short": (sizes["short"], None)}

    def arm(name: str) -> Arm:
        samples, min_tokens = runs[name]

        def build_artifact(bdir: Path) -> Command:
            extra = [] if min_tokens is None else ["--expert-min-tokens", str(min_tokens)]
            return Command([*WORKER, "quantize", "--src", str(src), "--out",
                            str(bdir / "artifact"), "--samples", str(samples),
                            "--seqlen", str(sizes["seqlen"]), *extra], timeout=timeout)

        def command(ctx: PassContext) -> Command:
            assert ctx.build_dir is not None
            return Command([*WORKER, "eval", "--src", str(src), "--artifact",
                            str(ctx.build_dir / "artifact"), "--windows",
                            str(sizes["eval_windows"]), "--seqlen", str(sizes["eval_seqlen"]),
                            "--json", str(ctx.workdir / "eval.json")], timeout=timeout)

        def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
            doc = json.loads((ctx.workdir / "eval.json").read_text())
            if min_tokens is not None and doc["experts_fallback"] != doc["experts"]:
                raise ValueError("the forced fallback did not reach every expert")
            return {"kl_mean": doc["kl_mean"], "top1": doc["top1"]}

        def extras(ctx: PassContext, run: RunRecord) -> dict:
            doc = json.loads((ctx.workdir / "eval.json").read_text())
            return {k: v for k, v in doc.items() if k not in ("kl_mean", "top1")}

        return Arm(name, {"samples": samples, "seqlen": sizes["seqlen"],
                          "expert_min_tokens": min_tokens}, command, collect,
                   build=build_artifact, extras=extras)

    arms = select([arm(n) for n in ARMS], opts.arms)
    return Suite(name="moe", description="per-expert GPTQ against round-to-nearest of the "
                 "experts on a tiny Qwen3-MoE (GGUF Q4_0 weights, scored in torch)",
                 metrics=[KL, TOP1], arms=arms, settings={"sizes": sizes, "model": str(src)},
                 baseline="experts-rtn" if any(a.name == "experts-rtn" for a in arms) else None,
                 inputs={"model": src / "model.safetensors"})


def _share(arm: str, doc: dict) -> str:
    shares = [r["extras"].get("fallback_share") for r in doc["records"]
              if r["arm"] == arm and r.get("ok")]
    shares = [s for s in shares if s is not None]
    return f"{100 * shares[0]:.1f}%" if shares else "—"


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table."""
    return harness_block(results, docs, "moe", "python -m benchmarks run moe",
                         {"experts that fell back": _share}, all_arms=list(ARMS))
