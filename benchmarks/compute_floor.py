"""The compute floor of a `cpu-quant gptq` run: what its phases would take at this machine's
GEMM throughput, measured at the run's own shapes, in the same process tree as the run.

For a checkpoint and a calibration (samples x seqlen in batches), the floor of each phase is
its FLOPs at the throughput one plain GEMM reaches on this CPU at that phase's shapes (each
shape timed here, best of ``REPEATS``):

``forward``   every decoder layer's linears on every calibration batch, in the run's compute
              dtype (``rows = batch x seqlen`` by ``K`` times ``K`` by ``N``), plus the causal
              attention (``scaled_dot_product_attention`` at the batch's shape)
``hessians``  ``XᵀX`` of every distinct linear input (q/k/v share one, gate/up one) on every
              batch, and the head's input once: a full float64 GEMM ``[K, rows] x [rows, K]``,
              the arithmetic whose sums are exact whatever the kernel (``hessians.gram``; the
              run's product computes only the upper blocks, so it can beat this)
``quantize``  GPTQ's sweep: about ``N K²`` FLOPs per linear (the lazy-batch updates), at
              the float32 throughput of ``[N, 128] x [128, K]``, plus one float32 Cholesky of
              each distinct ``K x K`` Hessian
``smoothing`` the statistics pass (the forward on its calibration batches) and the choice of
              strengths: for each fold, its linears on the sampled tokens in float32, once per
              candidate and once unsmoothed (``smooth_fold``), at the float32 throughput of
              ``[SAMPLE_TOKENS, hidden] x [hidden, intermediate]``

and ``write_seconds_per_byte``, this disk's sequential write throughput (a file of
``WRITE_BYTES`` written and fsynced): the artifact's bytes at it are the floor of writing.

``measure(checkpoint, samples, seqlen, batch_size)`` returns ``{"phases": {phase: {"flops",
"floor_seconds", "tflops"}}, "shapes": ..., "write_seconds_per_byte": ...}``.
``python -m benchmarks.compute_floor CKPT [--out FILE]`` writes it as JSON, with
``runtime_floor_bytes``: this process's RssAnon once it has imported the quantization pipeline
and before it allocates anything, the fixed part of a run's memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

REPEATS = 3
WRITE_BYTES = 512 * 1024 ** 2
SWEEP_BLOCK = 128
# linears that read the same input: one Hessian per group and layer
SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in",
                "gate_proj": "mlp_in", "up_proj": "mlp_in"}


def _best(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up: oneDNN's first call at a shape builds its kernel
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _time_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    return _best(lambda: a @ b)


def layer_linears(config: dict) -> dict[str, tuple[int, int]]:
    """One decoder layer's linears: short name -> (N out, K in), from a Llama-like config."""
    cfg = config.get("text_config") or config
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or hidden // heads)
    return {"q_proj": (heads * hd, hidden), "k_proj": (kv * hd, hidden),
            "v_proj": (kv * hd, hidden), "o_proj": (hidden, heads * hd),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def measure(checkpoint: Path, samples: int, seqlen: int, batch_size: int,
            workdir: Path | None = None) -> dict:
    from cpu_quant.quantize.streaming import compute_dtype

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    cfg = config.get("text_config") or config
    layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    vocab, heads = int(cfg["vocab_size"]), int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or hidden // heads)
    dtype = compute_dtype()
    batches = -(-samples // batch_size)
    rows = batch_size * seqlen
    linears = layer_linears(config)
    phases: dict[str, dict] = defaultdict(lambda: {"flops": 0.0, "floor_seconds": 0.0})
    shapes: dict[str, float] = {}

    def add(phase: str, flops: float, seconds: float) -> None:
        phases[phase]["flops"] += flops
        phases[phase]["floor_seconds"] += seconds

    # forward: each linear on one batch, and the attention
    x = torch.randn(rows, max(k for _, k in linears.values()), dtype=dtype)
    for name, (n, k) in linears.items():
        w = torch.randn(n, k, dtype=dtype)
        xk = x[:, :k].contiguous()
        t = _time_mm(xk, w.T)
        shapes[f"forward {name} [{rows},{k}]x[{k},{n}] {str(dtype)[6:]}"] = t
        add("forward", 2.0 * rows * n * k * layers * batches, t * layers * batches)
    q = torch.randn(batch_size, heads, seqlen, hd, dtype=dtype)
    t = _best(functools.partial(torch.nn.functional.scaled_dot_product_attention, q, q, q,
                                is_causal=True))
    shapes[f"forward attention [{batch_size},{heads},{seqlen},{hd}] causal"] = t
    add("forward", 2.0 * 2 * batch_size * heads * seqlen * seqlen * hd / 2 * layers * batches,
        t * layers * batches)
    # Hessians: one full XᵀX per distinct input and batch, and the head's once over all tokens
    inputs = {SHARED_INPUT.get(name, name): k for name, (_, k) in linears.items()}
    xd = x.to(torch.float64)
    for name, k in {**inputs, "lm_head": hidden}.items():
        xk = xd[:, :k].contiguous()
        t = _time_mm(xk.T, xk)
        shapes[f"hessian {name} [{k},{rows}]x[{rows},{k}] float64"] = t
        count = batches if name == "lm_head" else layers * batches
        add("hessians", 2.0 * rows * k * k * count, t * count)
    # sweeps: 2 N K² per linear at the float32 throughput of one lazy-batch update, and a
    # Cholesky per distinct Hessian
    sweeps = [(n, k, layers) for (n, k) in linears.values()] + [(vocab, hidden, 1)]
    for n, k, count in sweeps:
        err = torch.randn(n, SWEEP_BLOCK)
        hinv = torch.randn(SWEEP_BLOCK, k)
        t = _time_mm(err, hinv)
        flops_block = 2.0 * n * SWEEP_BLOCK * k
        flops = 1.0 * n * k * k  # 2 N B (K - i) summed over the K / B blocks
        shapes[f"sweep update [{n},{SWEEP_BLOCK}]x[{SWEEP_BLOCK},{k}] fp32"] = t
        add("quantize", flops * count, t * flops / flops_block * count)
    for name, k in {**inputs, "lm_head": hidden}.items():
        a = torch.randn(k, k)
        h = a @ a.T + k * torch.eye(k)
        t = _best(functools.partial(torch.linalg.cholesky, h), repeats=1)
        shapes[f"cholesky {name} [{k},{k}] fp32"] = t
        count = 1 if name == "lm_head" else layers
        add("quantize", k ** 3 / 3.0 * count, t * count)
    # smoothing: the statistics pass's forward, then the candidates' float32 GEMMs
    from cpu_quant.quantize import smooth_fold as sf

    stats = min(batches, sf.STATS_BATCHES)
    fwd = phases["forward"]
    add("smoothing", fwd["flops"] * stats / batches, fwd["floor_seconds"] * stats / batches)
    inter = linears["gate_proj"][0]
    xs, ws = torch.randn(sf.SAMPLE_TOKENS, hidden), torch.randn(inter, hidden)
    t = _time_mm(xs, ws.T)
    shapes[f"smoothing candidates [{sf.SAMPLE_TOKENS},{hidden}]x[{hidden},{inter}] fp32"] = t
    per_flop = t / (2.0 * sf.SAMPLE_TOKENS * hidden * inter)
    runs = len(sf.CANDIDATES) + 1  # every candidate, and the float output once
    params = sum(n * k for n, k in linears.values())
    sampled = min(sf.SAMPLE_TOKENS, stats * rows)  # a short calibration samples every token
    head_sampled = min(sf.HEAD_SAMPLE_TOKENS, stats * rows)
    flops = runs * 2.0 * (sampled * params * layers + head_sampled * vocab * hidden)
    add("smoothing", flops, flops * per_flop)
    write = write_seconds(workdir)
    shapes[f"write {WRITE_BYTES} B + fsync"] = write
    for p in phases.values():
        p["tflops"] = round(p["flops"] / p["floor_seconds"] / 1e12, 4) if p["flops"] else None
        p["floor_seconds"] = round(p["floor_seconds"], 3)
    return {"phases": dict(phases), "shapes": {k: round(v, 5) for k, v in shapes.items()},
            "write_seconds_per_byte": write / WRITE_BYTES,
            "compute_dtype": str(dtype), "threads": torch.get_num_threads(),
            "calibration": {"samples": samples, "seqlen": seqlen, "batch_size": batch_size}}


def write_seconds(workdir: Path | None = None) -> float:
    """Seconds to write and fsync :data:`WRITE_BYTES` sequentially in ``workdir``."""
    block = os.urandom(16 * 1024 ** 2)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-floor-") as f:
        t0 = time.perf_counter()
        for _ in range(WRITE_BYTES // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compute_floor")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import transformers  # noqa: F401  (what a run imports before it allocates)

    from cpu_quant import cli  # noqa: F401  (the gptq command's own imports)
    from cpu_quant.core.memory import anon_rss_bytes
    from cpu_quant.formats import cpu_int4, gguf, gptq  # noqa: F401
    from cpu_quant.quantize import pipeline  # noqa: F401

    runtime_floor = anon_rss_bytes(tree=False)
    result = measure(args.checkpoint, args.samples, args.seqlen, args.batch_size,
                     args.out.parent if args.out else None)
    result["runtime_floor_bytes"] = runtime_floor
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
