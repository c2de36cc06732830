"""Suite ``runtime``: vLLM serving speed and memory, bf16 vs GPTQ vs cpu_int4, on the demo model.

A thin wrapper over ``benchmarks/tinygemm_bench.py``, which holds the measurement: each pass of
an arm is one process (``python -m benchmarks.tinygemm_bench one-pass``) that starts
``vllm.LLM`` (every CPU of the affinity mask bound, prefix caching off, a 256 MiB KV cache
through ``kv_cache_memory_bytes``, a private ``VLLM_CACHE_ROOT`` per arm) and measures

``decode_tok_s``    batch 1, ``(N - 1) / (t(N tokens) - t(1 token))`` for a 16-token prompt,
                    best of 3 inside the pass (N = ``decode_tokens``: 64)
``prefill_tok_s``   a 512-token prompt, 1 output token: 512 / time, best of 3
``rss_anon_bytes``  RssAnon summed over the engine's process tree after ``LLM(...)`` returned
``start_seconds``   ``LLM(...)`` construction (engine start)

Arms (baseline ``bf16``):

``bf16``      the demo model's checkpoint (vLLM's unquantized CPU GEMM)
``gptq``      ``cpu-quant``'s GPTQ layout as users serve it (the head in groups of 32, as
              ``cpu-quant gptq`` writes it by default): the cpu_quant plugin installed, no
              switch set, so the kernel this CPU's row of ``cpu_quant.formats.kernels.KERNEL_TABLE``
              names (tinygemm on x86 without AMX; its log must hold the plugin's per-layer-type
              tinygemm line, or vLLM's ``CPUWNA16LinearKernel`` line where the row keeps vLLM's)
``gptq_head128``  the ``gptq`` layout with the head in the run's group (``--head-group 128``;
              64 on the demo model, whose 576 in-features 128 does not divide) instead of
              ``cpu-quant gptq``'s default 32: the decode cost of the head's smaller groups;
              not in the smoke run
``gptq_head_bf16``  the ``gptq`` layout with the head left bf16 (``--no-lm-head``); not in the
              smoke run
``gptq_stock``  the ``gptq`` checkpoint with ``CPU_QUANT_PATCH_GPTQ_TINYGEMM=0``: stock vLLM's
              kernel (its log must name ``CPUWNA16LinearKernel``); not in the smoke run
``gptq_w4a16``  the ``gptq`` checkpoint with ``VLLM_CPU_INT4_W4A8=0``, only where the CPU has
              AMX (elsewhere it is the ``gptq`` arm again): vLLM's W4A8 kernel switched off, so
              the plugin's table puts GPTQ layers on tinygemm (W4A16, exact); the speed that
              W4A8 buys over the exact kernel
``cpu_int4``  ``cpu-quant``'s tinygemm layout, served through the cpu_quant plugin (its log must
              hold the tinygemm layout line)

Every pass also records the RssAnon attribution (``tinygemm_bench.memory_attribution``: per
process, and the worker's counted weights and KV cache) in its extras.

The quantized checkpoints are built data-free (RTN, no calibration, no scale search) in the
work directory before the passes (``tinygemm_bench.build_artifacts``): decode speed does not
depend on trained or calibrated weights, so what is measured is the layout and its kernel.
``--artifact ARM=DIR`` serves DIR for that arm instead (the knob check above still applies).

**Stock vLLM without AVX-512.** vLLM's own CPU GPTQ kernel exists only in its AVX-512 builds
(``cpu_quant.formats.gptq.serving.stock_vllm_gptq_unavailable``): on a CPU without AVX-512 a real run refuses
to start while ``gptq_stock`` is among its arms, and a smoke run skips the arm and writes why
into the result (``skipped_arms``). The ``gptq`` arm runs there through the plugin's kernel.

Smoke mode (CI): the quantize suite's 2-layer random Llama (hidden 64, the demo tokenizer)
through real vLLM, ``enforce_eager``, 8 decode tokens and a 32-token prefill prompt. Measured
here (2 cores, AVX2): one engine start costs about a minute, nearly all of it three Python
processes importing vLLM, and ``torch.compile`` adds about 45 s more, hence eager; the demo
model instead of the tiny one adds its two quantizations and a slower prefill without
exercising anything more. Its numbers say nothing about speed.

``python -m benchmarks.tinygemm_bench`` keeps the larger random 0.5B Qwen2 model and the
kernel attribution (``kernel``).
"""

from __future__ import annotations

from pathlib import Path

from .. import tinygemm_bench as tb
from ..harness import SkippedArm, Suite
from ..render import harness_block
from .quantize import SuiteOptions, select, source_model

REAL = {"decode_tokens": 64, "prompt_len": tb.PROMPT_LEN, "eager": False}
SMOKE = {"decode_tokens": 8, "prompt_len": 32, "eager": True}


def stock_gptq_kernel_missing() -> str | None:
    """Why stock vLLM cannot run the ``gptq_stock`` arm on this CPU, or None when it can
    (``cpu_quant.formats.gptq.serving.stock_vllm_gptq_unavailable`` on this machine's /proc/cpuinfo)."""
    from cpu_quant.core.cpu import read_machine
    from cpu_quant.formats.gptq.serving import stock_vllm_gptq_unavailable

    return stock_vllm_gptq_unavailable(read_machine())


def build(opts: SuiteOptions) -> Suite:
    settings = SMOKE if opts.smoke else REAL
    prebuilt = {k: Path(v).resolve() for k, v in (opts.prebuilt or {}).items()}
    unknown = sorted(set(prebuilt) - set(tb.ARMS))
    if unknown:
        raise ValueError(f"--artifact names unknown arm(s): {', '.join(unknown)}; "
                         f"known: {', '.join(tb.ARMS)}")
    bad = [a for a in opts.arms or [] if a not in tb.ARMS]
    if bad:  # before minutes of quantization
        raise ValueError(f"unknown arm(s) {', '.join(bad)}; known: {', '.join(tb.ARMS)}")
    wanted = [a for a in tb.ARMS if not opts.arms or a in opts.arms]
    skipped = []
    if opts.smoke and not opts.arms and "gptq_stock" in wanted:
        # stock vLLM's GPTQ engine path (the plugin's kernel switched off) is tested by
        # tests/test_gptq_end_to_end.py where vLLM has it, so CI's smoke run saves the start
        skipped.append(SkippedArm("gptq_stock", "smoke: tested by test_gptq_end_to_end.py"))
        wanted.remove("gptq_stock")
    if opts.smoke and not opts.arms:  # the gptq arm's kernel path with another head: speed only
        for arm in tb.HEAD_ARMS:
            skipped.append(SkippedArm(arm, "smoke: the gptq arm runs the same kernels"))
            wanted.remove(arm)
        # the harness serves it as it serves the gptq arm; its engine path (the plugin's
        # cpu_int4 kernel from the checkpoint's config) is tests/test_tinygemm.py's vLLM test
        skipped.append(SkippedArm("cpu_int4", "smoke: the harness serves it as the gptq arm; "
                                  "its engine path is tested by test_tinygemm.py"))
        wanted.remove("cpu_int4")
    if not opts.arms:
        for arm in tb.AMX_ARMS:
            if opts.smoke:  # speed only: tinygemm's engine path is the cpu_int4 arm's
                skipped.append(SkippedArm(arm, "smoke: the cpu_int4 arm runs the same kernel"))
                wanted.remove(arm)
            elif not tb.has_amx():  # without AMX vLLM's W4A8 switch changes nothing
                skipped.append(SkippedArm(arm, "no AMX: the gptq arm already runs W4A16"))
                wanted.remove(arm)
    why = stock_gptq_kernel_missing()
    if why and "gptq_stock" in wanted:
        if not opts.smoke:  # only a smoke run may skip an arm: stop before any quantization
            raise ValueError(f"the gptq_stock arm cannot run here: {why}; measure the other "
                             "arms with --arms bf16,gptq,cpu_int4")
        skipped.append(SkippedArm("gptq_stock", why))
        wanted.remove("gptq_stock")
    src = source_model(opts)
    model = "demo" if opts.source is None and not opts.smoke else src.name
    inputs = opts.workdir / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    artifacts = tb.build_artifacts(model, inputs, [a for a in wanted if a not in prebuilt], src)
    artifacts.update({a: prebuilt[a] for a in wanted if a in prebuilt})
    artifacts = {a: artifacts[a] for a in tb.ARMS if a in artifacts}
    suite = tb.build_suite(model, artifacts, settings["decode_tokens"], settings["eager"],
                           name="runtime", prompt_len=settings["prompt_len"])
    suite.arms = select(suite.arms, [a for a in opts.arms if a in wanted] if opts.arms else None)
    for arm in suite.arms:
        arm.settings["prebuilt"] = str(prebuilt[arm.name]) if arm.name in prebuilt else None
    suite.skipped = skipped
    suite.baseline = "bf16" if any(a.name == "bf16" for a in suite.arms) else None
    suite.settings["source"] = str(src)
    if opts.smoke:
        suite.description += " (SMOKE)"
    suite.notes.append("quantized arms: RTN data-free (--calib none, no scale search), built "
                       "once before the passes; speed only, fidelity is the fidelity suite's")
    return suite


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table on each CPU class measured."""
    return harness_block(results, docs, "runtime", "python -m benchmarks run runtime", per_cpu=True)
