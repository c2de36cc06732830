"""Running 4-bit checkpoints on tinygemm: the linear op both runtimes call, and the plain-PyTorch loader.

``torch.ops.cpu_quant.int4pack_linear(x [M, K] bf16, packed, scale_zeros, group) -> [M, N]``
takes the weight in the kernel layout (``formats/cpu_int4/layout.py``) and picks a path by the
number of rows ``M``:

* ``M <= KERNEL_MAX_ROWS`` (decode steps): ``aten._weight_int4pack_mm_for_cpu``, the tinygemm
  kernel. Its cost grows linearly with ``M`` because it dequantizes the weight again for every
  block of 4 rows;
* larger ``M`` (prefill): the weight is dequantized tile by tile, one chunk of whole output
  blocks at a time, and each tile is multiplied by the dense GEMM in ``PREFILL_GEMM``.
  ``bfloat16`` (CPUs with a native bf16 GEMM): each tile of about four million weights
  (:data:`FUSED_CHUNK_WEIGHTS`) is dequantized to bf16 ``[rows, K]`` by a ``torch.compile``d
  function (:func:`_blocks_to_rows`) that reads the packed bytes once and writes the bf16 tile
  once, then multiplied in the orientation oneDNN runs fastest (weights ``[N, K]``, as
  ``F.linear``). Where it cannot compile (no C++ compiler), or with
  ``CPU_QUANT_INT4_FUSED_DEQUANTIZE=0``, the eager path below fills the same bf16 tiles
  instead. Both give the same bits at any thread count: the two dequantizers give the same bf16
  tile (elementwise arithmetic, no reduction), and the tiles are the same, so the GEMM calls
  are the same calls. (A GEMM's own bits may change with the thread count, which changes how
  oneDNN splits its work; so a result is reproducible for a given thread count.)
  ``float32`` (CPUs without native bf16, where a float32 GEMM is several times faster than a
  bf16 one): tiles of about a million weights dequantized into a float32 buffer reused by every
  chunk and every call (``formats/cpu_int4.dequantize_kernel_t_``: the kernel's float32
  arithmetic, read straight from the kernel layout) and multiplied as they are; the eager bf16
  tile is filled from such pieces, each rounded to bf16. No second copy of the weights is ever
  kept: the extra memory is one tile (a few MiB) and one tile's output.

Both settings come from this CPU's row of ``cpu_quant.formats.kernels.KERNEL_TABLE`` (the measurements
behind each row are there). ``CPU_QUANT_INT4_KERNEL_MAX_ROWS`` (e.g. 0: every batch through
the dequantize path) and ``CPU_QUANT_INT4_PREFILL_GEMM`` (``bfloat16`` or ``float32``) override
them for comparisons; both are read once, at import.

The branch on ``M`` lives inside a ``torch.library`` custom op, so a compiled graph (vLLM's
``torch.compile``) sees one opaque call and never guards or specialises on the batch size.
``PATH_CALLS`` counts the calls per path in this process, and the tiles the compiled dequantizer
made (a check that a path really ran).

``load_quantized(path)`` returns a transformers model whose quantized linears are
:class:`Int4PackedLinear` modules calling that op; everything else is the stock model.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import torch
from torch import nn

from ...core.cpu import local_cpu
from ...core.errors import CpuQuantError
from ..kernels import PREFILL_GEMMS, serving_kernels
from .layout import (
    CHUNK_WEIGHTS,
    QUANT_METHOD,
    block_codes,
    check_kernel_shape,
    dequantize_chunks,
    dequantize_codes,
    dequantize_kernel_t_,
    kernel_layout,
    repack_to_kernel_,
    scale_zero_storage,
)

PATH_CALLS = {"kernel": 0, "dequantize": 0, "fused_tiles": 0}
_GEMM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _kernel_max_rows() -> int:
    raw = os.environ.get("CPU_QUANT_INT4_KERNEL_MAX_ROWS")
    if raw is None or raw.strip() == "":
        return serving_kernels(local_cpu()).kernel_max_rows
    try:
        return int(raw)
    except ValueError:
        raise CpuQuantError(f"CPU_QUANT_INT4_KERNEL_MAX_ROWS={raw!r} is not an integer") from None


def _prefill_gemm() -> str:
    raw = os.environ.get("CPU_QUANT_INT4_PREFILL_GEMM", "").strip()
    if not raw:
        return serving_kernels(local_cpu()).prefill_gemm
    if raw not in PREFILL_GEMMS:
        raise CpuQuantError(f"CPU_QUANT_INT4_PREFILL_GEMM={raw!r} is not one of "
                            f"{', '.join(PREFILL_GEMMS)}")
    return raw


KERNEL_MAX_ROWS = _kernel_max_rows()
PREFILL_GEMM = _prefill_gemm()
_scratch = threading.local()


def _buffer(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, kept per thread and reused by every call
    (grown when a larger tile needs it)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = torch.empty(max(numel, CHUNK_WEIGHTS), dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:numel]


def _fused_dequantize_enabled() -> bool:
    raw = os.environ.get("CPU_QUANT_INT4_FUSED_DEQUANTIZE", "").strip()
    if raw not in ("", "0", "1"):
        raise CpuQuantError(f"CPU_QUANT_INT4_FUSED_DEQUANTIZE={raw!r} is not 0 or 1")
    return raw != "0"


FUSED_DEQUANTIZE = _fused_dequantize_enabled()
FUSED_CHUNK_WEIGHTS = 1 << 22  # weights per fused tile: 4 Mi measured fastest (1, 4 and 16 Mi tried)
RECOMPILE_LIMIT = 64
_fused: dict[str, object] = {}  # layout's full-block arrangement -> compiled function, or None


def _blocks_to_rows(blocks: torch.Tensor, sz: torch.Tensor, split: bool) -> torch.Tensor:
    """bf16 rows [B·bn, K] of ``blocks`` (uint8 [B, K, bn/2], whole kernel blocks) with their
    scale/zero pairs ``sz`` (bf16 [K/g, B·bn, 2]), as ``dequantize_kernel_rows`` gives them.
    Compiled, this is one pass over the packed bytes (every product ``(q - 8) · s`` is exact in
    float32, so a fused multiply-add rounds the same way)."""
    return dequantize_codes(block_codes(blocks, split), sz)


def _fused_rows(layout, packed: torch.Tensor, scale_zeros: torch.Tensor, start: int, stop: int
                ) -> torch.Tensor | None:
    """Rows ``start:stop`` (whole blocks) in bf16 through the compiled :func:`_blocks_to_rows`;
    None where it is switched off or cannot compile here (the caller then takes the eager
    path)."""
    if not FUSED_DEQUANTIZE:
        return None
    key = layout.full_block
    fn = _fused.get(key, False)
    if fn is None:
        return None
    bn, half = layout.block_n, packed.shape[1]
    blocks = packed[start:stop].view((stop - start) // bn, half * 2, bn // 2)
    sz = scale_zeros[:, start:stop].contiguous()  # strides that depend on the shape alone
    if fn is False:
        compiled = torch.compile(functools.partial(_blocks_to_rows, split=key == "split"),
                                 fullgraph=True, dynamic=False)
        try:
            out = _run(compiled, blocks, sz)
        except Exception as exc:  # no C++ compiler, an inductor bug: the eager path still runs
            import logging

            logging.getLogger(__name__).warning(
                "cpu_quant: fused dequantize did not compile (%s: %s); prefill dequantizes "
                "eagerly", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            _fused[key] = None
            return None
        _fused[key] = compiled
        return out
    return _run(fn, blocks, sz)


def _run(fn, blocks: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    # one specialised kernel per tile shape (a model has a handful: each linear's full tiles and
    # its last one), beyond dynamo's default of 8 per function, which would run it uncompiled
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return fn(blocks, sz)


def dequantize_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor,
                      group: int) -> torch.Tensor:
    """The op's path above the kernel's rows: tiles of the weight dequantized (by the
    ``PREFILL_GEMM`` and ``FUSED_DEQUANTIZE`` settings), each multiplied by a dense GEMM."""
    n, half = packed.shape
    k, m = half * 2, x.shape[0]
    gemm = _GEMM_DTYPES[PREFILL_GEMM]
    xg = x.to(gemm)
    out = torch.empty(m, n, dtype=x.dtype)
    layout = kernel_layout()
    fused = FUSED_DEQUANTIZE and gemm == torch.bfloat16
    # bf16: the compiled dequantizer's tiles, whichever dequantizer fills them (the same GEMM
    # calls, so the same bits); float32: the float32 buffer's tiles
    chunk = FUSED_CHUNK_WEIGHTS if gemm == torch.bfloat16 else CHUNK_WEIGHTS
    for start, stop in dequantize_chunks(packed, chunk):
        rows = stop - start
        weight = None
        if fused and rows % layout.block_n == 0:  # a partial last block: the eager path
            weight = _fused_rows(layout, packed, scale_zeros, start, stop)  # [rows, K] bf16
            PATH_CALLS["fused_tiles"] += weight is not None
        if weight is None and gemm == torch.float32:
            weight = dequantize_kernel_t_(packed, scale_zeros, group, start, stop,
                                          _buffer("w32", k * rows, torch.float32).view(k, rows),
                                          layout).t()  # [rows, K] view of the [K, rows] tile
        elif weight is None:
            weight = _eager_bf16_rows(packed, scale_zeros, group, start, stop, layout)
        tile = torch.mm(xg, weight.t(), out=_buffer("out", m * rows, gemm).view(m, rows))
        out[:, start:stop].copy_(tile)
    return out


def _eager_bf16_rows(packed: torch.Tensor, scale_zeros: torch.Tensor, group: int, start: int,
                     stop: int, layout) -> torch.Tensor:
    """Rows ``start:stop`` in bf16 ``[rows, K]`` (the orientation of F.linear's weight), in a
    buffer reused by every call: dequantized in float32 pieces of the float32 buffer's size,
    each rounded to bf16 into its rows (what :func:`_blocks_to_rows` gives, bit for bit)."""
    k, rows = packed.shape[1] * 2, stop - start
    weight = _buffer("w16", rows * k, torch.bfloat16).view(rows, k)
    for a, b in dequantize_chunks(packed[start:stop]):
        w_t = dequantize_kernel_t_(packed, scale_zeros, group, start + a, start + b,
                                   _buffer("w32", k * (b - a), torch.float32).view(k, b - a),
                                   layout)
        weight[a:b].copy_(w_t.t())
    return weight


@torch.library.custom_op("cpu_quant::int4pack_linear", mutates_args=())
def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor,
                    group: int) -> torch.Tensor:
    """x [M, K] bf16 @ W.T for a kernel-packed 4-bit W [N, K] -> [M, N] bf16."""
    x = x.contiguous()
    if x.shape[0] <= KERNEL_MAX_ROWS:
        PATH_CALLS["kernel"] += 1
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zeros)
    PATH_CALLS["dequantize"] += 1
    return dequantize_matmul(x, packed, scale_zeros, group)


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
        """Fill from the portable tensors (see ``formats/cpu_int4/layout.py``).

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


CONVERT_HINT = ("load_quantized runs only what the tinygemm kernel computes exactly; "
                "`cpu-quant convert {path} DST --to cpu_int4` repacks bit-exactly or names every "
                "module it cannot")


def load_quantized(path: str | Path):
    """A transformers model (bf16) whose quantized linears run the tinygemm kernel.

    ``path`` is a ``cpu_int4`` checkpoint, or any checkpoint of a safetensors format the formats
    registry reads (``gptq``: cpu-quant's, GPTQModel's, ...), whose modules are repacked to the
    ``cpu_int4`` layout on the way in (``formats.repack.repack_module``, the repack ``cpu-quant
    convert`` does, checked bit for bit). Every quantized module becomes an
    :class:`Int4PackedLinear` (the output head too, when quantized); all other tensors load
    unchanged. A module that cannot be held exactly (an act-order ``g_idx``, fp16 scales bf16
    would round, a shape the kernel cannot tile, ...) is refused with a ``CpuQuantError`` that
    names it; nothing but the checkpoint is read.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from ...core.io.checkpoint import open_checkpoint
    from .. import format_for_quant_method, get_format
    from ..repack import repack_module

    ckpt = open_checkpoint(path)
    qcfg = ckpt.config.get("quantization_config") or {}
    source = format_for_quant_method(qcfg.get("quant_method"))
    if source is None:
        raise CpuQuantError(f"{path} is not a checkpoint load_quantized reads (quant_method "
                            f"{qcfg.get('quant_method')!r}; it reads "
                            f"{', '.join(_readable_methods())})")
    if int(qcfg.get("bits", 4)) != 4:
        raise CpuQuantError(f"{path}: {qcfg.get('bits')}-bit weights; the tinygemm kernel is "
                            "4-bit")
    target = get_format(QUANT_METHOD)  # the runtime's own layout
    config = AutoConfig.from_pretrained(ckpt.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    modules = source.modules(ckpt)
    owned: set[str] = set()
    for name in modules:
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise CpuQuantError(f"{path}: quantized module {name} is not in the model") from None
        if not isinstance(linear, nn.Linear):
            raise CpuQuantError(f"{path}: {name} is not a linear layer")
        tensors = source.read_tensors(ckpt, name)
        if type(source) is not type(target):
            try:
                _, tensors = repack_module(source, target, tensors, qcfg, name)
            except CpuQuantError as exc:
                raise CpuQuantError(f"{path}: {exc}; {CONVERT_HINT.format(path=path)}") from None
        n, half = tensors["weight_packed"].shape
        k = half * 2
        group = k // tensors["weight_scale"].shape[1]
        if (n, k) != (linear.out_features, linear.in_features):
            raise CpuQuantError(f"{path}: {name} is [{n}x{k}] on disk, the config implies "
                                f"[{linear.out_features}x{linear.in_features}]")
        module = Int4PackedLinear(k, n, group, linear.bias is not None, name)
        module.load_portable(tensors["weight_packed"], tensors["weight_scale"],
                             tensors["weight_zero"])
        owned.update(f"{name}.{s}" for s in source.suffixes)
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


def _readable_methods() -> list[str]:
    from ..base import REGISTRY

    return sorted(m for cls in REGISTRY.values() for m in getattr(cls, "quant_methods", ()))
