"""Serving measurements: vLLM decode and prefill speed and memory, bf16 vs GPTQ vs cpu_int4.

The pass workers of the ``runtime`` and ``tinygemm`` suites (``benchmarks/suites/``):

    python -m benchmarks.tinygemm_bench one-pass MODEL OUT.json DECODE_TOKENS [--prompt-len N]
                                                 [--eager]
    python -m benchmarks.tinygemm_bench kernel NAME CKPT OUT.json [--threads N]

The suites' arms (one harness suite per model, baseline ``bf16``):

``bf16``      the source checkpoint (vLLM's unquantized CPU GEMM)
``gptq``      ``cpu-quant gptq`` layout as users serve it: the cpu_quant plugin installed, no
              switch set, so GPTQ layers run on the kernel this CPU's row of
              ``cpu_quant.formats.kernels.KERNEL_TABLE`` names (tinygemm on x86 without AMX)
``gptq_stock``  the ``gptq`` arm's checkpoint with ``CPU_QUANT_PATCH_GPTQ_TINYGEMM=0``: stock
              vLLM's kernel (``cpu_gemm_wna16``; absent from vLLM's AVX2 build;
              ``int4_scaled_mm_cpu``, W4A8, where the CPU has AMX)
``gptq_w4a16``  the ``gptq`` arm's checkpoint with ``VLLM_CPU_INT4_W4A8=0``, measured only where
              the CPU has AMX (elsewhere it is the ``gptq`` arm again): vLLM's W4A8 kernel
              switched off, so the plugin's table puts GPTQ layers on tinygemm (W4A16, exact)
``cpu_int4``  ``cpu-quant tinygemm`` layout, served through the cpu_quant plugin (tinygemm)
``llama.cpp-TYPE``  with ``--llama-cpp TYPE[,TYPE]`` (``q4_0``, ``q4_k_m``, ``q8_0``): the same
              bf16 checkpoint converted to GGUF and quantized by llama.cpp itself, run by
              llama-cpp-python 0.3.36 built for this CPU in a peer venv
              (``benchmarks/peers/llama_cpp_env.py``; built on first use, minutes), measured the
              same way (``benchmarks/peers/llama_cpp_pass.py``), every core as threads

Models: ``demo`` (SmolLM2-135M; per-step overhead dominates) and ``qwen05b``: a random-init
Qwen2 with Qwen2-0.5B's shapes (hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab
151936, tied embeddings), bandwidth-bound. Decode speed does not depend on trained weights, so
the quantized arms are built data-free (RTN, ``--calib none --no-scale-search``): the speed
measured is the layout's and the kernel's, not the calibration's. Fidelity is measured
elsewhere (``cpu-quant eval``, docs/tinygemm.md).

Each pass of an arm is one process (``one-pass``) that starts ``LLM(model)`` with
``VLLM_CPU_OMP_THREADS_BIND`` = every CPU of the affinity mask (vLLM's default binds one core
less), a private ``VLLM_CACHE_ROOT`` per arm (compile caches key on config), prefix caching off
and a 256 MiB KV cache, then measures:

``rss_anon_bytes``         RssAnon summed over the engine's process tree after start-up
``decode_tok_s``           batch 1: ``(N - 1) / (t(N tokens) - t(1 token))`` for a 16-token
                           prompt, N = ``--decode-tokens`` (64), best of 3 inside the pass
``prefill_tok_s``          a 512-token prompt, 1 output token: 512 / time, best of 3
``start_seconds``          ``LLM(...)`` construction

and, in the pass's extras, RssAnon after start-up attributed by counting
(:func:`memory_attribution`): per process of the tree (front end, engine core, worker,
inductor compile workers), and in the worker the bytes of the weights and of the KV cache.

Each pass checks its knobs (MEASURING.md rule 4): the engine's whole log (all processes) goes
to ``pass.json.log``; the cpu_int4 arm must log the tinygemm layout line, the gptq arm the
line of its kernel on this CPU (``default_gptq_knob``), the gptq_stock arm vLLM's ``Using
CPUWNA16LinearKernel``; and the pass must have run with exactly its arm's plugin switches
(``ARM_ENV``: none for every arm but gptq_stock and gptq_w4a16).

``kernel`` (attribution, MEASURING.md rule 9): in one process, with every core, the time of one
step's linear layers for each model's shapes, called one by one as the model calls them, at
M = 1 (decode; median of 50) and M = 512 (the prefill; median of 5; the head is left out, vLLM
computes logits for one position), through each path (:func:`kernel_attribution`: the op, the
tinygemm kernel alone, the op's dequantize path with a float32 and with a bf16 GEMM (the latter
also with its eager dequantizer, ``int4_bf16_eager``), the dequantize path for one row
(``dequantize_only``: the dequantization's share), vLLM's ``cpu_gemm_wna16`` where it exists
and its W4A8 ``int4_scaled_mm_cpu`` where the CPU has AMX, dense bf16 and float32 through
``F.linear``, and dense bf16 through vLLM's own prepacked oneDNN GEMM, ``onednn_bf16``); and the
kernel against the
dequantize path at M from 8 to 256, the measurement behind the kernel table's threshold. Set
beside the measured step time (1 / decode tok/s, 512 / prefill tok/s) of the suites, it splits
a step into the linears' share and the rest (attention, norms, sampling, vLLM's per-step
overhead).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

from cpu_quant.formats.gptq.vllm_kernel import KNOB_LINE as GPTQ_TINYGEMM_KNOB

from .harness import Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
PASS_TIMEOUT_S = 3600
KV_BYTES = 256 << 20
PROMPT_LEN = 512
DECODE_PROMPT_LEN = 16
METRICS = [
    Metric("decode_tok_s", "tok/s", "higher"),
    Metric("prefill_tok_s", "tok/s", "higher"),
    Metric("rss_anon_bytes", "B", "lower"),
    Metric("start_seconds", "s", "lower"),
]
QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
               max_position_embeddings=4096, tie_word_embeddings=True)
STOCK_GPTQ_KNOB = "Using CPUWNA16LinearKernel"


def default_gptq_knob(w4a8: bool = True) -> str:
    """What the ``gptq`` arm's log must hold on this CPU: the plugin's per-layer-type line where
    its kernel table puts GPTQ layers on tinygemm, vLLM's own kernel line elsewhere. ``w4a8``:
    vLLM's ``VLLM_CPU_INT4_W4A8`` switch (off, an AMX CPU's table row puts them on tinygemm)."""
    from cpu_quant.core.cpu import local_cpu
    from cpu_quant.formats.kernels import serving_kernels

    on_tinygemm = serving_kernels(local_cpu(), w4a8).gptq_kernel == "tinygemm"
    return GPTQ_TINYGEMM_KNOB if on_tinygemm else STOCK_GPTQ_KNOB


def has_amx() -> bool:
    from cpu_quant.core.cpu import local_cpu

    return local_cpu().amx


KNOBS = {"cpu_int4": "cpu_int4: tinygemm kernel layout",
         "gptq": default_gptq_knob(),
         "gptq_head128": default_gptq_knob(),
         "gptq_head_bf16": default_gptq_knob(),
         "gptq_stock": STOCK_GPTQ_KNOB,
         "gptq_w4a16": default_gptq_knob(w4a8=False)}
# arms that serve another arm's artifact with a switch set
SAME_ARTIFACT = {"gptq_stock": "gptq", "gptq_w4a16": "gptq"}
# the switches each arm runs with (exactly these; every pass checks it): the plugin's, and
# vLLM's W4A8 switch
ARM_ENV = {"gptq_stock": {"CPU_QUANT_PATCH_GPTQ_TINYGEMM": "0"},
           "gptq_w4a16": {"VLLM_CPU_INT4_W4A8": "0"}}
# arms that differ from ``gptq`` only where vLLM's W4A8 kernel runs (AMX): elsewhere the same
# engine path twice, so they are measured only where torch sees AMX tiles
AMX_ARMS = ("gptq_w4a16",)


def _switches() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith("CPU_QUANT_") or k == "VLLM_CPU_INT4_W4A8"}


# -- one pass (its own process) -----------------------------------------------------------------
def _timed(llm, prompt: list[int], max_tokens: int) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - t0


def one_pass(model: str, out: Path, decode_tokens: int, eager: bool,
             prompt_len: int = PROMPT_LEN) -> None:
    import random

    # the engine core and worker inherit these descriptors: their log lines land in one file,
    # where the knob check can read them
    log_path = out.with_name(out.name + ".log")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)

    from vllm import LLM

    from cpu_quant.core.memory import anon_rss_bytes

    t0 = time.perf_counter()
    llm = LLM(model=model, max_model_len=prompt_len + decode_tokens + 16, dtype="bfloat16",
              kv_cache_memory_bytes=KV_BYTES, enforce_eager=eager, seed=0,
              enable_prefix_caching=False)
    start = time.perf_counter() - t0
    rss = anon_rss_bytes(tree=True)
    memory = memory_attribution(llm)
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    _timed(llm, prompt(DECODE_PROMPT_LEN), 8)  # warm-up
    decode, prefill = [], []
    for _ in range(3):
        p = prompt(DECODE_PROMPT_LEN)
        one = _timed(llm, p, 1)
        many = _timed(llm, p, decode_tokens)
        decode.append((decode_tokens - 1) / max(many - one, 1e-9))
        prefill.append(prompt_len / _timed(llm, prompt(prompt_len), 1))
    sys.stdout.flush()
    sys.stderr.flush()
    log = log_path.read_text(errors="replace")
    import re

    bound = re.findall(r"local_rank=0, core ids=\[([0-9, ]*)\]", log)
    result = {"start_seconds": start, "rss_anon_bytes": rss, "memory": memory,
              "decode_tok_s": max(decode),
              "switches": _switches(),
              "decode_tokens": decode_tokens, "prompt_len": prompt_len, "enforce_eager": eager,
              "prefill_tok_s": max(prefill), "decode_all": decode, "prefill_all": prefill,
              "knobs": {arm: text in log for arm, text in KNOBS.items()},
              "omp_core_ids": [int(c) for c in bound[-1].split(",")] if bound else None}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)


# -- memory attribution (MEASURING.md rule 9: count, don't subtract) ------------------------------
def _worker_memory(worker) -> dict:
    """In a vLLM worker (``LLM.collective_rpc``): bytes of the model's unique tensor storages
    (parameters and buffers: the weights as they are held, packed or not) and of the KV cache's,
    each counted once, and the worker's own RssAnon. Both sets are written at start-up (weights
    loaded, the KV cache zero-filled), so their bytes are resident."""
    import os as _os

    from cpu_quant.core.memory import anon_rss_bytes

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model

    def storages(tensors) -> dict[int, int]:
        seen: dict[int, int] = {}
        for t in tensors:
            if t is not None and t.device.type == "cpu":
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return seen

    weights = storages([*model.parameters(), *model.buffers()])
    kv_list = runner.kv_caches
    kv_flat = [t for item in kv_list for t in (item if isinstance(item, (list, tuple)) else [item])]
    kv = storages(kv_flat)
    by_dtype: dict[str, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        by_dtype[str(t.dtype).removeprefix("torch.")] = \
            by_dtype.get(str(t.dtype).removeprefix("torch."), 0) + t.numel() * t.element_size()
    return {"pid": _os.getpid(), "weights_bytes": sum(weights.values()),
            "kv_cache_bytes": sum(kv.values()), "weights_by_dtype": by_dtype,
            "rss_anon_bytes": anon_rss_bytes(tree=False)}


def _role(pid: int, front_end: int, workers: set[int]) -> str:
    """front end (the ``LLM`` process), worker, compile worker (inductor's subprocess pool), or
    engine core / other vLLM process, from the pid and the command line."""
    if pid == front_end:
        return "front_end"
    if pid in workers:
        return "worker"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return "gone"
    if "compile_worker" in cmdline:
        return "compile_worker"
    return "engine_core_or_other"


def memory_attribution(llm) -> dict:
    """RssAnon after start-up, attributed by counting: per process of the engine's tree (front
    end, engine core, worker, inductor compile workers), and inside the worker the bytes of the
    weights and of the KV cache (their tensor storages, counted). ``worker_other_bytes`` is the
    worker's RssAnon beside those two counts (allocator, libraries, compiled code, buffers): the
    one figure not counted directly, labelled as such."""
    from cpu_quant.core.memory import descendant_pids, read_rss_anon_kib

    workers = llm.collective_rpc(_worker_memory)
    front = os.getpid()
    worker_pids = {w["pid"] for w in workers}
    processes = []
    for pid in [front, *descendant_pids(front)]:
        kib = read_rss_anon_kib(pid)
        if kib is not None:
            processes.append({"pid": pid, "role": _role(pid, front, worker_pids),
                              "rss_anon_bytes": kib * 1024})
    by_role: dict[str, int] = {}
    for p in processes:
        by_role[p["role"]] = by_role.get(p["role"], 0) + p["rss_anon_bytes"]
    weights = sum(w["weights_bytes"] for w in workers)
    kv = sum(w["kv_cache_bytes"] for w in workers)
    worker_rss = by_role.get("worker", 0)
    metrics = {"weights_bytes": weights, "kv_cache_bytes": kv,
               "compile_workers_rss_anon_bytes": by_role.get("compile_worker", 0),
               "runtime_processes_rss_anon_bytes": by_role.get("front_end", 0)
               + by_role.get("engine_core_or_other", 0),
               "worker_other_bytes": worker_rss - weights - kv}
    return {"processes": processes, "by_role": by_role, "workers": workers, "metrics": metrics}


# -- artifacts ------------------------------------------------------------------------------------
def random_qwen(dst: Path) -> Path:
    import shutil

    import torch
    import transformers

    from cpu_quant.models.demo import demo_model_path

    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    config = transformers.Qwen2Config(**QWEN05B)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    # any tokenizer will do for random ids; vLLM only needs one to start
    demo = demo_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, tmp / name)
    os.replace(tmp, dst)
    return dst


def _quantized(src: Path, dst: Path, arm: str) -> Path:
    from cpu_quant.formats import get_format
    from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint

    if not (dst / "config.json").is_file():
        # the gptq arms on the symmetric grid, the cpu_int4 arm on the asymmetric one
        fmt = "cpu_int4" if arm == "cpu_int4" else "gptq"
        settings = QuantSettings(method="rtn", calib="none", scale_search=False,
                                 symmetric=fmt == "gptq", **HEAD_LAYOUT.get(arm, {}))
        quantize_checkpoint(src, dst, settings, [get_format(fmt)], overwrite=True, progress=True)
    return dst


def _head_layouts() -> dict[str, dict]:
    from cpu_quant.quantize.plan import HEAD_GROUP

    # the head as `cpu-quant gptq` lays it out by default (RTN alone would take --group's
    # rule), and the two alternatives whose decode cost the head's choice weighs
    return {"gptq": {"head_group": HEAD_GROUP}, "gptq_head128": {"head_group": 128},
            "gptq_head_bf16": {"quantize_head": False}}


HEAD_LAYOUT = _head_layouts()
ARMS = ("bf16", "gptq", "gptq_head128", "gptq_head_bf16", "gptq_stock", "gptq_w4a16", "cpu_int4")
# arms that only weigh the head's layout: not in a smoke run (the gptq arm runs the same path)
HEAD_ARMS = ("gptq_head128", "gptq_head_bf16")


def build_artifacts(model: str, workdir: Path, arms: tuple[str, ...] | list[str] = ARMS,
                    src: Path | None = None) -> dict[str, Path]:
    """The checkpoint each arm serves (``arms``, in ``ARMS`` order), quantized when missing;
    ``src`` replaces ``model``'s bf16 checkpoint (``model`` then only names the outputs)."""
    from cpu_quant.models.demo import demo_model_path

    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if src is None:
        src = demo_model_path() if model == "demo" else random_qwen(workdir / "qwen05b-bf16")

    def artifact(arm: str) -> Path:
        arm = SAME_ARTIFACT.get(arm, arm)
        return src if arm == "bf16" else _quantized(src, workdir / f"{model}-{arm}-rtn", arm)

    return {arm: artifact(arm) for arm in ARMS if arm in arms}


# -- kernel attribution ---------------------------------------------------------------------------
def _decode_linears(config: dict) -> list[tuple[str, int, int, int]]:
    """(name, N, K, group) of the linears one decode step calls, as vLLM fuses them."""
    from cpu_quant.formats import get_format
    from cpu_quant.quantize.plan import choose_group

    limits = get_format("gptq").limits
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    layers = config["num_hidden_layers"]
    shapes = [("qkv_proj", (heads + 2 * kv) * head_dim, h), ("o_proj", h, heads * head_dim),
              ("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)]
    out = [(f"layers.*.{n}", nn, k, choose_group(n, k, 128, False, limits)[0])
           for n, nn, k in shapes
           for _ in range(layers)]
    vocab = config["vocab_size"]
    out.append(("lm_head", vocab, h, choose_group("lm_head", h, 128, False, limits)[0]))
    return out


ROWS = (1, 512)  # a decode step (batch 1) and the benchmark's 512-token prefill


def _median_ms(fn, reps: int = 50) -> float:
    import statistics

    for _ in range(min(reps, 5)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _wna16_layer(n: int, k: int, g: int, w4a8: bool = False):
    """A layer holding random symmetric GPTQ weights [n, k], prepared by vLLM's own
    ``CPUWNA16LinearKernel`` exactly as vLLM prepares a GPTQ layer on this CPU, with
    ``VLLM_CPU_INT4_W4A8`` set to ``w4a8``; returns (kernel, layer), or None where vLLM cannot
    run that kernel here (``cpu_gemm_wna16`` is absent from its AVX2 build; the W4A8 kernel
    ``int4_scaled_mm_cpu`` needs AMX)."""
    import torch
    from vllm.model_executor.kernels.linear import CPUWNA16LinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearLayerConfig,
    )
    from vllm.scalar_type import scalar_types

    from cpu_quant.formats.gptq.layout import pack_gptq_qweight

    if w4a8 and not (torch.cpu._is_amx_tile_supported()
                     and hasattr(torch.ops._C, "int4_scaled_mm_cpu")):
        return None
    if not w4a8 and not hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return None
    config = MPLinearLayerConfig(full_weight_shape=(k, n), partition_weight_shape=(k, n),
                                 weight_type=scalar_types.uint4b8, act_type=torch.bfloat16,
                                 group_size=g, zero_points=False)
    layer = torch.nn.Module()
    layer.bias = None
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    # plain parameters with the attributes vLLM's loader would have given them (its parameter
    # classes need a tensor-parallel group, which only an engine sets up)
    qweight = torch.nn.Parameter(pack_gptq_qweight(codes), requires_grad=False)
    qweight.input_dim, qweight.output_dim, qweight.packed_dim = 0, 1, 0
    scales = torch.nn.Parameter(torch.full((k // g, n), 0.01, dtype=torch.bfloat16),
                                requires_grad=False)
    scales.input_dim, scales.output_dim = 0, 1
    layer.register_parameter("qweight", qweight)
    layer.register_parameter("scales", scales)
    # the zero-point name lets the W4A8 preparation attach the all-8 zero points it needs
    kernel = CPUWNA16LinearKernel(config, "qweight", "scales", "qzeros")
    saved = os.environ.get("VLLM_CPU_INT4_W4A8")
    os.environ["VLLM_CPU_INT4_W4A8"] = "1" if w4a8 else "0"
    try:
        kernel.process_weights_after_loading(layer)
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_INT4_W4A8")
        else:
            os.environ["VLLM_CPU_INT4_W4A8"] = saved
    if layer.use_w4a8 != w4a8:
        raise RuntimeError(f"vLLM prepared the layer with use_w4a8={layer.use_w4a8}, "
                           f"asked for {w4a8}")
    return kernel, layer


SWEEP_ROWS = (8, 16, 32, 48, 64, 96, 128, 192, 256)  # where the kernel stops paying


def _apply(made):
    """x -> the prepared vLLM layer's output, for ``(kernel, layer)`` from :func:`_wna16_layer`;
    None for None."""
    return None if made is None else functools.partial(made[0].apply_weights, made[1])


def _onednn_bf16(w):
    """vLLM's own dense bf16 GEMM on CPU for the weight ``w`` [n, k]: the oneDNN handle with the
    weight prepacked that vLLM's unquantized linear method creates
    (``dispatch_cpu_unquantized_gemm``), as a function of x; None where this build lacks it
    or oneDNN has no bf16 matmul for this CPU (AVX2 without AVX512-BF16)."""
    from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        return None
    try:
        handler = ops.create_onednn_mm(w.t(), 32)
    except RuntimeError:  # "could not create a primitive descriptor for the matmul primitive"
        return None
    return lambda x: ops.onednn_mm(handler, x, None)


def _path_times(rows: int, k: int, g: int, packed, storage, w, vllm_paths, dequantize_path
                ) -> dict[str, float]:
    """Median ms of one call per path (see :func:`kernel_attribution`) at ``rows`` rows."""
    import torch
    import torch.nn.functional as F

    xk = torch.randn(rows, k).to(torch.bfloat16)
    w32 = w.float()
    reps = 50 if rows == 1 else 5
    arms = {
        "int4": lambda: torch.ops.cpu_quant.int4pack_linear(xk, packed, storage, g),
        "kernel": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xk, packed, g, storage),
        "bf16": lambda: F.linear(xk, w),
        "f32": lambda: F.linear(xk.float(), w32),
    }
    if rows > 1:
        arms["int4_f32"] = lambda: dequantize_path(xk, packed, storage, g, "float32")
        arms["int4_bf16"] = lambda: dequantize_path(xk, packed, storage, g, "bfloat16")
        arms["int4_bf16_eager"] = lambda: dequantize_path(xk, packed, storage, g, "bfloat16",
                                                          fused=False)
        # the same path for one row: the tiles are dequantized as at M = 512, the product is a
        # matrix-vector one, so this is (nearly) the dequantization's share alone
        arms["dequantize_only"] = lambda: dequantize_path(xk[:1], packed, storage, g,
                                                          "bfloat16")
    for arm, fn in vllm_paths.items():
        if fn is not None:
            arms[arm] = functools.partial(fn, xk)
    return {arm: round(_median_ms(fn, reps), 4) for arm, fn in arms.items()}


def _sweep_times(rows: int, k: int, g: int, packed, storage, dequantize_path, gemm: str
                 ) -> dict[str, float]:
    """The tinygemm kernel against the op's dequantize path (``gemm``) at ``rows`` rows."""
    import torch

    xk = torch.randn(rows, k).to(torch.bfloat16)
    return {"kernel_ms": round(_median_ms(
                lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xk, packed, g, storage), 5), 4),
            "dequantize_ms": round(_median_ms(
                lambda: dequantize_path(xk, packed, storage, g, gemm), 5), 4)}


def kernel_attribution(model: str, src: Path) -> dict:
    """Median time of one decode step's linears (M = 1) and of a prefill's (M = 512), called in
    order, per path:

    ``int4``      the ``cpu_quant::int4pack_linear`` op as configured (kernel at M = 1; at
                  M = 512 dequantize + this CPU's prefill GEMM)
    ``int4_f32`` / ``int4_bf16``  at M = 512, the op's dequantize path with each prefill GEMM
    ``kernel``    the tinygemm kernel alone (``_weight_int4pack_mm_for_cpu``), at both M
    ``dequantize_only``  at M = 512, the dequantize path for one row: the tiles made as at
                  M = 512 with a matrix-vector product, the dequantization's share of ``int4``
    ``wna16``     vLLM's ``cpu_gemm_wna16`` (stock GPTQ without AMX), where this build has it
    ``w4a8``      vLLM's ``int4_scaled_mm_cpu`` (stock GPTQ with AMX: int8 activations)
    ``bf16`` / ``f32``  the dense GEMM (``F.linear``) on weights of that dtype
    ``onednn_bf16``  vLLM's own dense bf16 GEMM on CPU (oneDNN, the weight prepacked once), the
                  GEMM its bf16 arm serves with

    and, for the layer linears of one step (the head left out), the kernel against the op's
    dequantize path at each M of ``SWEEP_ROWS``: the measured threshold of the kernel table."""
    import torch

    from cpu_quant.formats.cpu_int4 import kernel as rt
    from cpu_quant.formats.cpu_int4 import layout as tp

    config = json.loads((src / "config.json").read_text())
    linears = _decode_linears(config)
    unique = {}
    for name, n, k, g in linears:
        if (name, n, k, g) in unique:
            continue
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        storage, sview, zview = tp.scale_zero_storage(n, k, g)
        sview.fill_(0.01)
        zview.fill_(0.001)
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        unique[(name, n, k, g)] = (tp.torch_pack(codes), storage, w,
                                   {"wna16": _apply(_wna16_layer(n, k, g)),
                                    "w4a8": _apply(_wna16_layer(n, k, g, w4a8=True)),
                                    "onednn_bf16": _onednn_bf16(w)})
    configured = rt.PREFILL_GEMM

    configured_fused = rt.FUSED_DEQUANTIZE

    def dequantize_path(xk, packed, storage, g, gemm, fused=configured_fused):
        rt.PREFILL_GEMM, rt.FUSED_DEQUANTIZE = gemm, fused
        try:
            return rt.dequantize_matmul(xk, packed, storage, g)
        finally:
            rt.PREFILL_GEMM, rt.FUSED_DEQUANTIZE = configured, configured_fused

    per_module = []
    for (name, n, k, g), (packed, storage, w, vllm_paths) in unique.items():
        count = sum(1 for lin in linears if lin == (name, n, k, g))
        row = {"module": name, "n": n, "k": k, "group": g, "calls_per_step": count,
               "int4_bytes": n * k // 2 + 4 * n * (k // g), "bf16_bytes": 2 * n * k}
        for rows in ROWS:
            if rows > 1 and name == "lm_head":  # the prefill computes logits for one position
                continue
            row.update({f"{arm}_ms_m{rows}": ms for arm, ms in
                        _path_times(rows, k, g, packed, storage, w, vllm_paths,
                                    dequantize_path).items()})
        if name != "lm_head":
            row["sweep"] = {rows: _sweep_times(rows, k, g, packed, storage, dequantize_path,
                                               configured) for rows in SWEEP_ROWS}
        per_module.append(row)
        print(f"{model} {name}: {row}", file=sys.stderr, flush=True)

    def step(key: str) -> float:
        return round(sum((m.get(key) or 0.0) * m["calls_per_step"] for m in per_module), 3)

    arms = ("int4", "kernel", "bf16", "onednn_bf16", "f32", "wna16", "w4a8", "int4_f32",
            "int4_bf16", "int4_bf16_eager", "dequantize_only")
    steps = {f"{arm}_m{rows}": step(f"{arm}_ms_m{rows}") for arm in arms for rows in ROWS
             if any(f"{arm}_ms_m{rows}" in m for m in per_module)}
    sweep = {rows: {path: round(sum(m["sweep"][rows][path] * m["calls_per_step"]
                                    for m in per_module if "sweep" in m), 3)
                    for path in ("kernel_ms", "dequantize_ms")} for rows in SWEEP_ROWS}
    crossover = next((rows for rows in SWEEP_ROWS
                      if sweep[rows]["dequantize_ms"] < sweep[rows]["kernel_ms"]), None)
    return {"model": model, "torch_threads": torch.get_num_threads(), "rows": list(ROWS),
            "kernel_max_rows": rt.KERNEL_MAX_ROWS, "prefill_gemm": configured,
            "modules": per_module, "linears_ms_per_step": steps,
            "layer_linears_ms_per_step_by_rows": sweep,
            "first_rows_where_dequantize_wins": crossover}


def kernel_pass(model: str, src: Path, out: Path, threads: int | None) -> dict:
    """The worker of the ``tinygemm`` suite's kernel part: :func:`kernel_attribution` of
    ``src``'s shapes in this process, written to ``out``."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    result = kernel_attribution(model, src)
    result["settings"] = {"m_rows": list(ROWS), "reps": {"1": 50, "512": 5},
                          "sweep_rows": list(SWEEP_ROWS), "statistic": "median",
                          "threads": threads or "all"}
    out.write_text(json.dumps(result, indent=1))
    print(f"{model}: linears per step (ms): {result['linears_ms_per_step']}", file=sys.stderr)
    return result


# -- the suite ------------------------------------------------------------------------------------
def omp_bind() -> str:
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def _arm(name: str, path: Path, decode_tokens: int, eager: bool,
         prompt_len: int = PROMPT_LEN) -> Arm:
    def command(ctx: PassContext) -> Command:
        # VLLM_ALLOW_INSECURE_SERIALIZATION: lets the pass send memory_attribution's counting
        # function to the worker (collective_rpc); it changes nothing else
        env = {"VLLM_CACHE_ROOT": str(ctx.workdir.parent.parent / f"vllm-cache-{name}"),
               "VLLM_CPU_OMP_THREADS_BIND": omp_bind(), "VLLM_LOGGING_LEVEL": "INFO",
               "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **ARM_ENV.get(name, {})}
        argv = [sys.executable, "-m", "benchmarks.tinygemm_bench", "one-pass", str(path),
                str(ctx.workdir / "pass.json"), str(decode_tokens), "--prompt-len",
                str(prompt_len)] + (["--eager"] if eager else [])
        return Command(argv, env=env, cwd=str(REPO), timeout=PASS_TIMEOUT_S)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        data = json.loads((ctx.workdir / "pass.json").read_text())
        if name in KNOBS and not data["knobs"][name]:
            raise HarnessError(f"{name}: the log lacks {KNOBS[name]!r}; the arm did not run its "
                               "kernel")
        for key, want in (("decode_tokens", decode_tokens), ("prompt_len", prompt_len),
                          ("enforce_eager", eager)):
            if data.get(key) != want:
                raise HarnessError(f"{name}: the pass ran with {key}={data.get(key)}, not {want}")
        cores = sorted(os.sched_getaffinity(0))
        if data.get("omp_core_ids") != cores:
            raise HarnessError(f"{name}: vLLM bound its OpenMP threads to "
                               f"{data.get('omp_core_ids')}, not every core {cores}")
        if data.get("switches") != ARM_ENV.get(name, {}):
            raise HarnessError(f"{name}: the pass ran with the switches "
                               f"{data.get('switches')}, not {ARM_ENV.get(name, {})}")
        return {m.name: float(data[m.name]) for m in METRICS}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        data = json.loads((ctx.workdir / "pass.json").read_text())
        return {"decode_all": data["decode_all"], "prefill_all": data["prefill_all"],
                "omp_core_ids": data.get("omp_core_ids"), "memory": data.get("memory"),
                "loadavg_after": os.getloadavg()}

    return Arm(name, {"model": str(path), "env": ARM_ENV.get(name, {})}, command, collect,
               extras=extras)


def _llama_arm(gguf_type: str, path: Path, python: Path, decode_tokens: int,
               prompt_len: int = PROMPT_LEN) -> Arm:
    """llama.cpp serving ``path`` (a GGUF) through llama-cpp-python, measured the way
    ``one_pass`` measures vLLM (``benchmarks/peers/llama_cpp_pass.py``)."""
    from .peers.llama_cpp_env import PASS_SCRIPT

    name = f"llama.cpp-{gguf_type}"

    def command(ctx: PassContext) -> Command:
        argv = [str(python), str(PASS_SCRIPT), str(path), str(ctx.workdir / "pass.json"),
                str(decode_tokens), str(prompt_len)]
        return Command(argv, cwd=str(REPO), timeout=PASS_TIMEOUT_S)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        data = json.loads((ctx.workdir / "pass.json").read_text())
        for key, want in (("decode_tokens", decode_tokens), ("prompt_len", prompt_len),
                          ("n_threads", len(os.sched_getaffinity(0)))):
            if data.get(key) != want:
                raise HarnessError(f"{name}: the pass ran with {key}={data.get(key)}, not {want}")
        return {m.name: float(data[m.name]) for m in METRICS}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        data = json.loads((ctx.workdir / "pass.json").read_text())
        return {"decode_all": data["decode_all"], "prefill_all": data["prefill_all"],
                "system_info": data["system_info"], "loadavg_after": os.getloadavg()}

    return Arm(name, {"model": str(path), "runtime": "llama-cpp-python", "gguf_type": gguf_type},
               command, collect, extras=extras)


def llama_arms(src: Path, workdir: Path, types: list[str], decode_tokens: int,
               prompt_len: int = PROMPT_LEN) -> tuple[list[Arm], dict]:
    """The llama.cpp arms for ``src`` (peer venv built when missing, GGUFs cached in
    ``workdir``), and the peer's description for the result's notes."""
    from .peers import llama_cpp_env

    env = llama_cpp_env.install()  # main() has checked the types before any work
    files = llama_cpp_env.gguf_files(env, src, workdir, types)
    return ([_llama_arm(t, files[t], env.python, decode_tokens, prompt_len) for t in types],
            env.describe())


def build_suite(model: str, artifacts: dict[str, Path], decode_tokens: int, eager: bool,
                name: str | None = None, prompt_len: int = PROMPT_LEN,
                extra_arms: list[Arm] | None = None) -> Suite:
    return Suite(
        name=name or f"tinygemm-{model}",
        description=(f"vLLM CPU decode (batch 1) and prefill ({prompt_len} tokens) speed and "
                     f"RssAnon, bf16 vs GPTQ vs cpu_int4, on {model}"),
        metrics=METRICS,
        arms=[_arm(n, p, decode_tokens, eager, prompt_len) for n, p in artifacts.items()]
        + list(extra_arms or []),
        baseline="bf16" if "bf16" in artifacts else None,
        settings={"model": model, "decode_tokens": decode_tokens, "prompt_len": prompt_len,
                  "kv_cache_memory_bytes": KV_BYTES, "enforce_eager": eager,
                  "VLLM_CPU_OMP_THREADS_BIND": omp_bind(),
                  "quantized_arms": "RTN data-free, no scale search (speed only)"},
        inputs=dict(artifacts),
        notes=["knob check: the cpu_int4 arm's log must hold the tinygemm layout line and the "
               "gptq arm's vLLM's CPUWNA16LinearKernel line (pass.json.log in each pass dir)"],
    )


def main(argv: list[str] | None = None) -> int:
    """The pass workers of the ``runtime`` and ``tinygemm`` suites."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tinygemm_bench",
                                 description=main.__doc__)
    sub = ap.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("one-pass", help="one engine start and its measurements")
    one.add_argument("model")
    one.add_argument("out", type=Path)
    one.add_argument("decode_tokens", type=int)
    one.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    one.add_argument("--eager", action="store_true")
    ker = sub.add_parser("kernel", help="the linears of one step, path by path")
    ker.add_argument("model", help="a name for the shapes (demo, qwen05b, ...)")
    ker.add_argument("src", type=Path, help="the checkpoint whose config gives the shapes")
    ker.add_argument("out", type=Path)
    ker.add_argument("--threads", type=int, default=None,
                     help="torch threads (default: every core, as vLLM binds them)")
    args = ap.parse_args(argv)
    if args.mode == "one-pass":
        one_pass(args.model, args.out, args.decode_tokens, args.eager, args.prompt_len)
    else:
        kernel_pass(args.model, args.src, args.out, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
