"""Running ``cpu_int4`` checkpoints: the linear op both runtimes call, and the plain-PyTorch loader.

``torch.ops.cpu_quant.int4pack_linear(x [M, K] bf16, packed, scale_zeros, group) -> [M, N]``
takes the weight in the kernel layout (``formats/cpu_int4.py``) and picks a path by the
number of rows:

* ``M <= KERNEL_MAX_ROWS`` (decode steps): ``aten._weight_int4pack_mm_for_cpu``, the tinygemm
  kernel. Its cost grows linearly with ``M`` because it dequantizes the weight again for every
  block of 4 rows;
* larger ``M`` (prefill): the weight is dequantized to bf16 straight from the kernel layout,
  one chunk of whole output blocks (about a million weights) at a time, each multiplied with
  the ordinary bf16 GEMM into its slice of the output. No second copy of the weight is kept.

Measured here (AVX-512, one thread, min of 15; [1536x576] and [576x1536] weights): the kernel
takes 0.03 ms at M=1, 0.34 ms at M=32, 0.68 ms at M=64 and 1.37 ms at M=128; dequantize+GEMM
takes 0.84, 0.84-0.91, 0.91 and 1.23-1.70 ms. The crossover lies between 64 and 128 rows, so
``KERNEL_MAX_ROWS`` is 64 (``CPU_QUANT_INT4_KERNEL_MAX_ROWS`` overrides it, e.g. 0 to send every
batch through the dequantize path for a comparison).

The branch on ``M`` lives inside a ``torch.library`` custom op, so a compiled graph (vLLM's
``torch.compile``) sees one opaque call and never guards or specialises on the batch size.
``PATH_CALLS`` counts the calls per path in this process (a check that a path really ran).

``load_quantized(path)`` returns a transformers model whose quantized linears are
:class:`Int4PackedLinear` modules calling that op; everything else is the stock model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .errors import CpuQuantError
from .formats.cpu_int4 import (
    QUANT_METHOD,
    check_kernel_shape,
    dequantize_chunks,
    dequantize_kernel_rows,
    repack_to_kernel_,
    scale_zero_storage,
)

KERNEL_MAX_ROWS_DEFAULT = 64
PATH_CALLS = {"kernel": 0, "dequantize": 0}


def _kernel_max_rows() -> int:
    raw = os.environ.get("CPU_QUANT_INT4_KERNEL_MAX_ROWS")
    if raw is None or raw.strip() == "":
        return KERNEL_MAX_ROWS_DEFAULT
    try:
        return int(raw)
    except ValueError:
        raise CpuQuantError(f"CPU_QUANT_INT4_KERNEL_MAX_ROWS={raw!r} is not an integer") from None


KERNEL_MAX_ROWS = _kernel_max_rows()


def _dequantize_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor,
                       group: int) -> torch.Tensor:
    # out is built transposed ([N, M]) so each chunk's GEMM writes contiguous rows
    out_t = torch.empty(packed.shape[0], x.shape[0], dtype=x.dtype)
    for start, stop in dequantize_chunks(packed):
        w = dequantize_kernel_rows(packed, scale_zeros, group, start, stop)
        torch.mm(w, x.t(), out=out_t[start:stop])
    return out_t.t().contiguous()


@torch.library.custom_op("cpu_quant::int4pack_linear", mutates_args=())
def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor,
                    group: int) -> torch.Tensor:
    """x [M, K] bf16 @ W.T for a kernel-packed 4-bit W [N, K] -> [M, N] bf16."""
    x = x.contiguous()
    if x.shape[0] <= KERNEL_MAX_ROWS:
        PATH_CALLS["kernel"] += 1
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zeros)
    PATH_CALLS["dequantize"] += 1
    return _dequantize_matmul(x, packed, scale_zeros, group)


@int4pack_linear.register_fake
def _int4pack_linear_fake(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor,
                          group: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def apply_int4pack(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` through the op, with an optional bias."""
    lead = x.shape[:-1]
    out = torch.ops.cpu_quant.int4pack_linear(x.reshape(-1, x.shape[-1]), packed, scale_zeros,
                                              group)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, packed.shape[0])


class Int4PackedLinear(nn.Module):
    """A bf16 linear layer whose weight is held in the tinygemm kernel layout."""

    def __init__(self, in_features: int, out_features: int, group: int, bias: bool,
                 name: str = "module") -> None:
        super().__init__()
        check_kernel_shape(name, out_features, in_features, group)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        # empty: load_portable adopts the checkpoint's tensor, so these pages are never touched
        self.register_buffer("packed", torch.empty(out_features, in_features // 2,
                                                   dtype=torch.uint8))
        storage, self._scale_view, self._zero_view = scale_zero_storage(
            out_features, in_features, group)
        self.register_buffer("scale_zeros", storage)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=torch.bfloat16),
                                 requires_grad=False) if bias else None

    def load_portable(self, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                      weight_zero: torch.Tensor) -> None:
        """Fill from the portable tensors (see ``formats/cpu_int4.py``).

        ``weight_packed`` is repacked to the kernel layout in place and kept as the buffer (the
        caller hands over a tensor it owns, as ``Checkpoint.tensor`` returns): no second copy of
        the matrix, and the repack's extra memory is one chunk."""
        if weight_packed.shape != self.packed.shape or weight_scale.shape != self._scale_view.shape \
                or weight_zero.shape != self._zero_view.shape:
            raise CpuQuantError(f"cpu_int4 tensors of shape {list(weight_packed.shape)}, "
                                f"{list(weight_scale.shape)} do not fit a "
                                f"[{self.out_features}x{self.in_features}] g{self.group} linear")
        if weight_packed.dtype != torch.uint8:
            raise CpuQuantError(f"weight_packed is {weight_packed.dtype}, expected uint8")
        self.packed = repack_to_kernel_(weight_packed.contiguous())
        self._scale_view.copy_(weight_scale)
        self._zero_view.copy_(weight_zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_int4pack(x.to(torch.bfloat16), self.packed, self.scale_zeros, self.group,
                              self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.group}, bias={self.bias is not None}")


def load_quantized(path: str | Path):
    """A transformers model (bf16) whose quantized linears run the tinygemm kernel.

    Every module with ``weight_packed`` in the checkpoint becomes an :class:`Int4PackedLinear`
    (the output head too, when quantized); all other tensors load unchanged. Nothing but the
    checkpoint is read; ``path`` must be a ``cpu_int4`` checkpoint directory.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    qcfg = ckpt.config.get("quantization_config") or {}
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise CpuQuantError(f"{path} is not a cpu_int4 checkpoint (quant_method "
                            f"{qcfg.get('quant_method')!r})")
    config = AutoConfig.from_pretrained(ckpt.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    modules = sorted(n[: -len(".weight_packed")] for n in ckpt.names
                     if n.endswith(".weight_packed"))
    owned: set[str] = set()
    for name in modules:
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise CpuQuantError(f"{path}: quantized module {name} is not in the model") from None
        if not isinstance(linear, nn.Linear):
            raise CpuQuantError(f"{path}: {name} is not a linear layer")
        n, half = ckpt.shape(f"{name}.weight_packed")
        k = half * 2
        group = k // ckpt.shape(f"{name}.weight_scale")[1]
        if (n, k) != (linear.out_features, linear.in_features):
            raise CpuQuantError(f"{path}: {name} is [{n}x{k}] on disk, the config implies "
                                f"[{linear.out_features}x{linear.in_features}]")
        module = Int4PackedLinear(k, n, group, linear.bias is not None, name)
        module.load_portable(ckpt.tensor(f"{name}.weight_packed"),
                             ckpt.tensor(f"{name}.weight_scale"),
                             ckpt.tensor(f"{name}.weight_zero"))
        owned.update(f"{name}.{s}" for s in ("weight_packed", "weight_scale", "weight_zero"))
        if linear.bias is not None:
            module.bias.copy_(ckpt.tensor(f"{name}.bias"))
            owned.add(f"{name}.bias")
        model.set_submodule(name, module)
    state = {n: ckpt.tensor(n).to(torch.bfloat16) for n in ckpt.names if n not in owned}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith("inv_freq")
               and m.rpartition(".")[0] not in modules]
    if missing or unexpected:
        bad = (missing or unexpected)[0]
        raise CpuQuantError(f"{path}: tensors and config disagree "
                            f"({'missing' if missing else 'unexpected'} {bad})")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    ckpt.close()
    return model.eval()
