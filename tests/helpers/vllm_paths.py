"""Which 4-bit kernel stock vLLM runs a GPTQ layer on here, and how far its greedy tokens may
stray from a torch model holding the dequantized weights on that kernel. Shared by the tests
that serve GPTQ checkpoints in vLLM."""

from __future__ import annotations

import os

# Where vLLM and the torch model may pick different greedy tokens. From the first step where
# they differ on, the two continue from different contexts, so only that step is judged: the
# reference's token must lie within this many nats of vLLM's own choice in vLLM's log-probs:
# - W4A16 (vLLM's cpu_gemm_wna16, or the plugin's tinygemm kernel; bf16 activations): the
#   bf16 near-tie (both round logits to bf16, whose spacing at logit magnitudes of 8-32 is
#   0.0625-0.25, and their GEMMs reduce in another order). Measured: 4 of 5 sequences
#   identical, the fifth split at a margin of 0.0.
# - W4A8 (vLLM's int4_scaled_mm_cpu, the default where the CPU has AMX): the reference is the
#   same torch model with every linear computed as that kernel does (``reference_context``:
#   int8 per token, float32 GEMM), which equals the kernel's output after bf16 rounding layer by
#   layer. The model as a whole does not: the rest of it (attention, norms, the residual adds)
#   rounds differently from vLLM's, and the int8 grid turns a last-bit difference in an
#   activation row into a whole step of some code, which 30 layers amplify. Measured on an AMX
#   Xeon (the demo model's default artifact, 12 prompts x 24 tokens): vLLM split from this
#   reference at top-2 margins of up to 0.5 nats (a float32 copy of the reference, just as
#   exact per linear, at up to 0.375), and teacher-forced, the reference put vLLM's tokens up
#   to 0.875 nats below its own best. Twice the largest split margin. A misread checkpoint is
#   far outside it: the same reference with every weight read at zero point 7 instead of 8
#   split from the right one at the first token of test_gptq_end_to_end's 4 prompts, by
#   8.0-10.8 nats.
NEAR_TIE_NATS = {"w4a16": 0.3, "w4a8": 1.0}


def stock_vllm_gptq_path() -> str:
    """Which kernel vLLM's CPUWNA16LinearKernel runs a bf16 GPTQ layer on here
    (``vllm/model_executor/kernels/linear/mixed_precision/cpu.py``): ``int4_scaled_mm_cpu``
    (W4A8) where torch sees AMX tiles and ``VLLM_CPU_INT4_W4A8`` is not 0 (its default is 1),
    else ``cpu_gemm_wna16`` (W4A16)."""
    import torch

    return "w4a8" if torch.cpu._is_amx_tile_supported() and _w4a8_switch() else "w4a16"


def vllm_gptq_path() -> str:
    """The same with the cpu_quant plugin on (no switch set): W4A16 where its kernel table puts
    GPTQ layers on tinygemm (bf16 activations), else vLLM's own choice."""
    from cpu_quant.core.cpu import local_cpu
    from cpu_quant.formats.kernels import serving_kernels

    if serving_kernels(local_cpu(), _w4a8_switch()).gptq_kernel == "tinygemm":
        return "w4a16"
    return stock_vllm_gptq_path()


def _w4a8_switch() -> bool:
    return os.environ.get("VLLM_CPU_INT4_W4A8", "1") != "0"


def reference_context(model, path: str):
    """The block in which ``model`` (dequantized weights) computes as vLLM's ``path`` does."""
    from contextlib import nullcontext

    from cpu_quant.eval.fidelity import w4a8_activations

    return w4a8_activations(model) if path == "w4a8" else nullcontext()
