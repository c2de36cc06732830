"""Suite ``memory``: peak RssAnon of ``cpu-quant gptq`` does not grow with the number of layers.

Synthetic models are built from the demo model's layer shapes (SmolLM2-135M: hidden 576,
intermediate 1536, 9 heads, 3 KV heads, vocabulary 49152, untied head after quantization) at
1x, 2x and 4x its depth (30, 60, 120 decoder layers: 0.27, 0.48 and 0.91 GB of bf16), random
weights with a fixed seed and the demo tokenizer. Peak memory does not depend on trained weights;
the calibration text is the real built-in corpus.

Arms (interleaved by the harness, each pass a fresh process; baseline ``depth-1x``):

``depth-1x``, ``depth-2x``, ``depth-4x``
    ``cpu-quant gptq SRC DST --group 128 --samples 8 --seqlen 512 --no-eval`` (head quantized,
    the default job's settings apart from the calibration size, kept small so that three
    passes over 210 layers fit in well under an hour here)
``calib-32``, ``calib-32-offload``
    the 1x model with ``--samples 32`` (4x the calibration activations), in memory and with
    ``--offload-activations``

The allocator arms, measured only when named with ``--arms``:

``calib-128``, ``calib-128-mmap-4m``, ``calib-128-mmap-16m``
    the 1x model with the default job's calibration size (128 x 512), with glibc's moving mmap
    threshold and with ``MALLOC_MMAP_THRESHOLD_`` fixing it at 4 and 16 MiB (baseline
    ``calib-128`` when ``depth-1x`` is not selected): what a fixed threshold costs in time when
    every calibration batch's large temporaries are mapped afresh
    (``python -m benchmarks run memory --arms calib-128,calib-128-mmap-4m,calib-128-mmap-16m``)
``depth-1x-mmap-4m`` ... ``depth-4x-mmap-16m``
    the depth arms with the threshold fixed by ``MALLOC_MMAP_THRESHOLD_`` (the first
    ``depth-1x*`` arm selected is the baseline)

What the ratios should show: ``depth-2x`` and ``depth-4x`` at 1.0 within the spread (the driver
holds one decoder layer, the calibration activations, and the embedding and head); ``calib-32``
above 1.0 by the extra activations (24 x 512 x 576 bf16 = 13.5 MiB per copy, two copies while a
layer is re-run, plus the larger per-layer call records), ``calib-32-offload`` back near
``depth-1x``.

Smoke mode (CI): a tiny random Llama at 2, 4 and 8 layers, 4 x 64 calibration tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ..harness import CPU_SECONDS, PEAK_RSS_ANON, WALL_SECONDS, Arm, Command, PassContext, RunRecord, Suite
from ..render import harness_block
from .quantize import SuiteOptions, select

CLI = [sys.executable, "-m", "cpu_quant.cli"]
MODEL_VERSION = 1
REAL = {"base_layers": 30, "depths": (1, 2, 4), "samples": 8, "seqlen": 512, "batch_size": 8,
        "group": 128, "calib_samples": 32, "default_samples": 128, "mmap_thresholds_mib": (4, 16)}
SMOKE = {"base_layers": 2, "depths": (1, 2, 4), "samples": 4, "seqlen": 64, "batch_size": 2,
         "group": 128, "calib_samples": 8, "default_samples": 16, "mmap_thresholds_mib": (4,)}
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at start: the same as mallopt(M_MMAP_THRESHOLD)
TIMEOUT_REAL = 2 * 3600
TIMEOUT_SMOKE = 600


def synthetic_model(dst: Path, layers: int, smoke: bool, seed: int = 0) -> Path:
    """The demo model's shapes (or the smoke model's) at ``layers`` decoder layers, bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cpu_quant.models.demo import demo_model_path

    if (dst / "config.json").is_file() and (dst / "cpu_quant_synthetic.json").is_file():
        return dst
    demo = demo_model_path()
    if smoke:
        from transformers import LlamaConfig

        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                             vocab_size=49152, max_position_embeddings=2048,
                             tie_word_embeddings=True)
    else:
        config = AutoConfig.from_pretrained(demo)
        config.num_hidden_layers = layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(demo).save_pretrained(staging)
    (staging / "cpu_quant_synthetic.json").write_text(json.dumps(
        {"version": MODEL_VERSION, "layers": layers, "seed": seed, "shapes_from": str(demo)}) + "\n")
    del model
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(staging, dst)
    return dst


def _bf16_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def quantize_arm(name: str, src: Path, samples: int, settings: dict, flags: list[str],
                 timeout: float, env: dict[str, str] | None = None) -> Arm:
    def argv(dst: Path) -> list[str]:
        return [*CLI, "gptq", str(src), str(dst), "--group", str(settings["group"]),
                "--samples", str(samples), "--seqlen", str(settings["seqlen"]),
                "--batch-size", str(settings["batch_size"]), "--no-eval", "--overwrite", *flags]

    def command(ctx: PassContext) -> Command:
        return Command(argv(ctx.workdir / "artifact"), env=dict(env or {}), timeout=timeout)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        report = json.loads((ctx.workdir / "artifact" / "quantization_report.json").read_text())
        if report["calibration_tokens"] != samples * settings["seqlen"]:
            raise ValueError(f"calibration_tokens {report['calibration_tokens']} != "
                             f"{samples}x{settings['seqlen']}")
        if report["settings"]["offload_activations"] != ("--offload-activations" in flags):
            raise ValueError("--offload-activations did not reach the pipeline")
        threshold = (env or {}).get(MMAP_ENV)
        if threshold and report["provenance"].get("malloc_mmap_threshold") != int(threshold):
            raise ValueError(f"{MMAP_ENV}={threshold} did not reach the quantizer")
        return {}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        report = json.loads((ctx.workdir / "artifact" / "quantization_report.json").read_text())
        return {"layers": len(report["layer_seconds"]), "tool_total_seconds": report["total_seconds"],
                "source_bf16_bytes": _bf16_bytes(src)}

    cfg = json.loads((src / "config.json").read_text())
    return Arm(name, {"source": str(src), "layers": cfg["num_hidden_layers"], "samples": samples,
                      "seqlen": settings["seqlen"], "batch_size": settings["batch_size"],
                      "group": settings["group"], "flags": flags, "env": dict(env or {}),
                      "source_bf16_bytes": _bf16_bytes(src)},
               command, collect, artifacts=lambda ctx: {"artifact": ctx.workdir / "artifact"},
               extras=extras)


def build(opts: SuiteOptions) -> Suite:
    settings = dict(SMOKE if opts.smoke else REAL)
    timeout = TIMEOUT_SMOKE if opts.smoke else TIMEOUT_REAL
    inputs = opts.workdir / "inputs"
    models = {d: synthetic_model(inputs / f"depth-{d}x", settings["base_layers"] * d, opts.smoke)
              for d in settings["depths"]}
    s = settings["samples"]
    offload = ["--offload-activations"]
    arms = [quantize_arm(f"depth-{d}x", models[d], s, settings, [], timeout)
            for d in settings["depths"]]
    c = settings["calib_samples"]
    arms += [quantize_arm(f"calib-{c}", models[1], c, settings, [], timeout),
             quantize_arm(f"calib-{c}-offload", models[1], c, settings, offload, timeout)]
    default_selection = [a.name for a in arms]  # what a run without --arms measures
    # the allocator arms (only with --arms): the default calibration size, glibc's moving
    # mmap threshold against
    # fixed ones (time is what they measure: a fixed threshold maps every large temporary anew)
    d = settings["default_samples"]
    arms += [quantize_arm(f"calib-{d}", models[1], d, settings, [], timeout)]
    arms += [quantize_arm(f"calib-{d}-mmap-{m}m", models[1], d, settings, [], timeout,
                          env={MMAP_ENV: str(m << 20)}) for m in settings["mmap_thresholds_mib"]]
    # the depth arms again with a fixed threshold: does it keep the peak flat with depth?
    arms += [quantize_arm(f"depth-{dd}x-mmap-{m}m", models[dd], s, settings, [], timeout,
                          env={MMAP_ENV: str(m << 20)})
             for m in settings["mmap_thresholds_mib"] for dd in settings["depths"]]
    arms = select(arms, opts.arms or default_selection)
    names = [a.name for a in arms]
    baseline = "depth-1x" if "depth-1x" in names else next(
        (n for n in names if n.startswith("depth-1x") or n == f"calib-{d}"), None)
    return Suite(
        name="memory",
        description="Peak RssAnon (process tree) of cpu-quant gptq on synthetic models of the "
                    f"{'smoke' if opts.smoke else 'demo'} model's shapes at "
                    f"{', '.join(f'{d}x' for d in settings['depths'])} depth, and with "
                    f"{c} calibration samples in memory and offloaded",
        metrics=[PEAK_RSS_ANON, WALL_SECONDS, CPU_SECONDS],
        arms=arms,
        settings={k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
        baseline=baseline,
        inputs={f"depth_{d}x_config": m / "config.json" for d, m in models.items()},
        notes=["Random weights with the demo model's shapes: memory and time do not depend on "
               "trained weights. Calibration: the built-in corpus."],
    )


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table."""
    return harness_block(results, docs, "memory", "python -m benchmarks run memory")
