"""``cpu_int4``: W4A16 checkpoints for PyTorch's tinygemm CPU kernel.

The kernel is ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zeros)``
(bf16 activations, 4-bit weights, float32 accumulation, bf16 output). Its packed weight depends
on the ISA path torch dispatches to (AVX-512, AVX2, the default path), so the checkpoint stores a
portable layout and the runtime builds the kernel's at load time.

On disk (portable)
==================

Per quantized linear ``<m>`` with out-features ``N``, in-features ``K`` and group ``g``:

==================  ========  ==========  ====================================================
tensor              dtype     shape       content
==================  ========  ==========  ====================================================
``weight_packed``   uint8     [N, K/2]    two codes per byte, low nibble first:
                                          ``weight_packed[n, j] = q[n, 2j] | q[n, 2j+1] << 4``,
                                          ``q ∈ [0, 15]``
``weight_scale``    bfloat16  [N, K/g]    ``scale[n, i]`` of group ``i`` (columns ``ig..ig+g-1``)
``weight_zero``     bfloat16  [N, K/g]    ``zero[n, i]``, a float offset (not a code)
==================  ========  ==========  ====================================================

Dequantization: ``w[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g]``, in float32
(the product is exact; the sum is rounded once), which is what the kernel computes. The
symmetric grid (``--sym``, or a GPTQ repack) is the special case ``zero == 0``. Scales may be
negative (see ``core/grid.py``).

``quantization_config`` (in ``config.json``):

* ``quant_method``: ``"cpu_int4"``; ``format_version``: 1 (this docstring);
* ``bits``: 4; ``group_size``: the default group, one of 32, 64, 128, 256 (the kernel's);
* ``sym``: true when every zero is 0 (informational: the runtime always reads the zeros);
* ``lm_head``: the output head is quantized (its tensors are ``lm_head.weight_*``);
* ``dynamic``: per-module overrides, the GPTQModel/vLLM convention shared with the GPTQ layout
  (``quantize/plan.py``): ``"+:<regex>": {"group_size": G}`` gives matching modules group
  ``G``; ``"-:<regex>": {}`` leaves them bf16 (``<m>.weight``). Regexes are ``re.match``-ed
  against both the Hugging Face names and vLLM's fused names (``qkv_proj``, ``gate_up_proj``);
  the first matching rule wins;
* ``embedding``: ``"bf16"``: the input embedding is stored unquantized (``docs/tinygemm.md``
  has the measurement behind keeping it bf16 rather than sharing the 4-bit head);
* provenance: ``quantizer``, ``damp_percent``, ``cpu_quant`` (method, scale search), as written
  by the pipeline.

The kernel layout (built at load, never on disk)
================================================

``torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K], _)`` returns uint8
``[N, K/2]``; measured on this machine's three ISA paths (``ATEN_CPU_CAPABILITY``), torch 2.13:

* rows form output blocks of ``BN`` rows: 64 on AVX-512, 32 on AVX2 and on the default path;
  the last block holds ``N mod BN`` rows when ``BN`` does not divide ``N``;
* a block of ``size`` rows starting at row ``r`` occupies rows ``r .. r+size-1`` of the
  ``[N, K/2]`` view, stored K-major: byte ``(k, j)`` of the block is at ``k * size/2 + j``;
* a full block on AVX-512 and AVX2 is *split*: byte ``j`` holds row ``j`` in the low nibble and
  row ``j + BN/2`` in the high nibble;
* a partial block (16, 32 or 48 rows), and every block on the default path, is *paired*:
  byte ``j`` holds row ``2j`` (low nibble) and row ``2j + 1`` (high nibble).

Scales and zeros go to the kernel as one bf16 tensor ``[K/g, N, 2]``: ``[i, n, 0]`` is the
scale and ``[i, n, 1]`` the zero. The kernel needs ``N % 16 == 0`` (its output blocks are 16,
32, 48 or 64 rows), ``K % g == 0``, ``g ∈ {32, 64, 128, 256}`` and bf16 activations when the
scales are bf16. A shape outside these is refused with a ``CpuQuantError``, and
:func:`kernel_layout` checks the description above against torch's own packer (full and partial
blocks) before anything reads packed bytes: a torch whose layout differs stops loudly instead of
being mis-read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ...core.errors import CpuQuantError
from ...core.grid import QZERO, GroupQuant
from ..base import Limits, Serving, TensorSpec
from ..safetensors import SafetensorsFormat
from ..sink import ArtifactInfo
from .serving import PROBE_RULES, refuse_experts

QUANT_METHOD = "cpu_int4"
FORMAT_VERSION = 1
BITS = 4
TENSORS = ("weight_packed", "weight_scale", "weight_zero")
KERNEL_GROUPS = (32, 64, 128, 256)
KERNEL_ROW_MULTIPLE = 16
# Rows per chunk are chosen so a chunk holds about this many weights: its int32 copy for torch's
# packer (4 bytes a weight) then stays near 4 MiB whatever the matrix, so the load-time peak does
# not grow with the largest matrix (the head of a 150k-vocab model is a billion weights).
CHUNK_WEIGHTS = 1 << 20


# -- the portable layout ----------------------------------------------------------------------
def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) -> uint8 [N, K/2], low nibble = even column."""
    n, k = codes.shape
    if k % 2:
        raise ValueError(f"cannot pack an odd number of columns ({k})")
    c = codes.to(torch.uint8).reshape(n, k // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes uint8 [N, K]."""
    n, half = packed.shape
    return torch.stack([packed & 0xF, packed >> 4], -1).reshape(n, half * 2)


def dequantize_cpu_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                        weight_zero: torch.Tensor) -> torch.Tensor:
    """Reference dequantization of one module to float32 [N, K]."""
    codes = unpack_codes(weight_packed)
    n, k = codes.shape
    groups = weight_scale.shape[1]
    if weight_scale.shape != (n, groups) or weight_zero.shape != (n, groups) or k % groups:
        raise CpuQuantError(f"cpu_int4 tensors disagree: weight_packed {list(weight_packed.shape)}, "
                            f"weight_scale {list(weight_scale.shape)}, "
                            f"weight_zero {list(weight_zero.shape)}")
    q = codes.to(torch.float32).reshape(n, groups, k // groups) - QZERO
    w = q * weight_scale.to(torch.float32).unsqueeze(-1) + weight_zero.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k)


def kernel_shape_problem(n: int, k: int, group: int) -> str | None:
    """Why the tinygemm kernel cannot take an [n, k] weight with this group; None if it can."""
    if group not in KERNEL_GROUPS:
        return (f"group {group} is not one the tinygemm kernel takes "
                f"({', '.join(map(str, KERNEL_GROUPS))})")
    if k % group:
        return f"group {group} does not divide the in-features {k}"
    if n % KERNEL_ROW_MULTIPLE:
        return (f"out-features {n} is not a multiple of {KERNEL_ROW_MULTIPLE}: the kernel's output "
                "blocks (16, 32, 48 or 64 rows) cannot tile it")
    return None


def check_kernel_shape(name: str, n: int, k: int, group: int) -> None:
    problem = kernel_shape_problem(n, k, group)
    if problem:
        raise CpuQuantError(f"{name} [{n}x{k}] cannot be stored as cpu_int4: {problem}")


def cpu_int4_module_tensors(gq: GroupQuant, name: str = "module") -> dict[str, torch.Tensor]:
    """One quantization result (symmetric or not) in the portable layout (suffix -> tensor)."""
    n, k = gq.codes.shape
    check_kernel_shape(name, n, k, gq.group_size)
    zeros = torch.zeros_like(gq.scales) if gq.zeros is None else gq.zeros
    return {
        "weight_packed": pack_codes(gq.codes),
        "weight_scale": gq.scales.to(torch.bfloat16).contiguous(),
        "weight_zero": zeros.to(torch.bfloat16).contiguous(),
    }


def cpu_int4_quantization_config(group_size: int, lm_head: bool, dynamic: dict[str, dict],
                                 symmetric: bool, extra: dict | None = None) -> dict:
    cfg = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "bits": BITS,
        "group_size": group_size,
        "sym": symmetric,
        "lm_head": lm_head,
        "dynamic": dynamic,
        "embedding": "bf16",
    }
    cfg.update(extra or {})
    return cfg


class CpuInt4Format(SafetensorsFormat, name="cpu_int4"):
    quant_methods = (QUANT_METHOD,)
    vllm_method = f"{__package__}.vllm_method"  # the quantization method the plugin registers
    summary = "tinygemm"
    command = "tinygemm"
    probe_rules = PROBE_RULES

    def serving(self, target: Path) -> Serving:
        return Serving("vLLM and the cpu_quant plugin (`pip install cpu-quant[vllm]`; vLLM loads "
                       "the plugin through its `vllm.general_plugins` entry point, no flag "
                       "needed)", f"VLLM_CPU_KVCACHE_SPACE=1 vllm serve {target}")

    def refuse_source(self, source_config: dict) -> str | None:
        return refuse_experts(source_config)
    # the tinygemm kernel has no one-group-per-row mode; -1 is read only where K is a kernel group
    limits = Limits(groups=(128, 64, 32), row_group=False, k_multiple=32, n_multiple=32,
                    stores_zeros=True, kernel="torch's tinygemm kernel (_weight_int4pack_mm_for_cpu)")
    # what verify accepts: every group the kernel takes, and any even K / row count it tiles
    verify_groups = KERNEL_GROUPS
    verify_k_multiple, verify_n_multiple = 2, 1
    tensors = (
        TensorSpec("weight_packed", ("U8",), lambda n, k, g, b: (n, k // 2)),
        TensorSpec("weight_scale", ("BF16",), lambda n, k, g, b: (n, g)),
        TensorSpec("weight_zero", ("BF16",), lambda n, k, g, b: (n, g)),
    )
    marker = "weight_packed"
    scales_suffix, scales_group_axis = "weight_scale", 1
    head_kernel = "the tinygemm W4A16 kernel"

    def dims_from_marker(self, shape: tuple[int, ...], bits: int) -> tuple[int, int]:
        return shape[0], shape[1] * 2

    def pack(self, gq: GroupQuant, module: str = "module") -> dict[str, torch.Tensor]:
        return cpu_int4_module_tensors(gq, module)

    def unpack(self, tensors: dict[str, torch.Tensor], qcfg: dict, module: str = "module"
               ) -> GroupQuant:
        _check_format_version(qcfg)
        codes = unpack_codes(tensors["weight_packed"])
        n, k = codes.shape
        scales = tensors["weight_scale"].to(torch.float32)
        zeros = tensors["weight_zero"].to(torch.float32)
        groups = scales.shape[1]
        if scales.shape != (n, groups) or zeros.shape != (n, groups) or not groups or k % groups:
            raise CpuQuantError(f"{module}: cpu_int4 tensors disagree: weight_packed "
                                f"{list(tensors['weight_packed'].shape)}, weight_scale "
                                f"{list(scales.shape)}, weight_zero {list(zeros.shape)}")
        return GroupQuant(codes, scales, None if not bool(zeros.any()) else zeros, k // groups)

    def dequantize(self, tensors: dict[str, torch.Tensor], qcfg: dict) -> torch.Tensor:
        _check_format_version(qcfg)
        return dequantize_cpu_int4(tensors["weight_packed"], tensors["weight_scale"],
                                   tensors["weight_zero"])

    def quantization_config(self, info: ArtifactInfo) -> dict:
        return cpu_int4_quantization_config(info.default_group, info.head_quantized, info.dynamic,
                                            info.symmetric, info.extra)

    def module_findings(self, ctx):
        """With sym true, every weight_zero must be 0."""
        from ...core.findings import error

        for mod in ctx.modules.values():
            tname = mod.tensors.get("weight_zero")
            if tname is None or mod.params is None or not mod.params.sym:
                continue
            nonzero = int(torch.count_nonzero(ctx.ckpt.tensor(tname)))
            if nonzero:
                yield error("zero-convention", tname, f"sym is true, but {nonzero} group zeros "
                            "are not 0")


def _check_format_version(qcfg: dict) -> None:
    if int(qcfg.get("format_version", FORMAT_VERSION)) != FORMAT_VERSION:
        raise CpuQuantError(f"cpu_int4 format_version {qcfg.get('format_version')} is not "
                            f"supported (this cpu_quant reads {FORMAT_VERSION})")


# -- the kernel layout ----------------------------------------------------------------------
@dataclass(frozen=True)
class KernelLayout:
    """How torch's packer arranges codes on one ISA path (see the module docstring)."""

    isa: str
    block_n: int
    full_block: str  # "split" or "paired"

    def blocks(self, n: int) -> list[tuple[int, int]]:
        """(first row, rows) of every output block of an N-row weight."""
        return [(r, min(self.block_n, n - r)) for r in range(0, n, self.block_n)]

    def _is_split(self, size: int) -> bool:
        return self.full_block == "split" and size == self.block_n

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Reference packer: codes [N, K] -> the kernel's uint8 [N, K/2]."""
        n, k = codes.shape
        c = codes.to(torch.uint8)
        out = torch.empty(n, k // 2, dtype=torch.uint8)
        for r, size in self.blocks(n):
            blk = c[r:r + size].t()  # [K, size]
            if self._is_split(size):
                lo, hi = blk[:, : size // 2], blk[:, size // 2:]
            else:
                lo, hi = blk[:, 0::2], blk[:, 1::2]
            out[r:r + size] = (lo | (hi << 4)).reshape(size, k // 2)
        return out

    def codes(self, packed: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Codes uint8 [stop-start, K] of rows ``start:stop`` of a kernel-packed weight.

        ``start`` and ``stop`` must fall on block boundaries (or ``stop == N``): a range that cuts
        a block cannot be read without its other half, so it is refused, not guessed.
        """
        n, half = packed.shape
        stop = n if stop is None else stop
        bn = self.block_n
        if start % bn or (stop % bn and stop != n) or not 0 <= start < stop <= n:
            raise ValueError(f"rows {start}:{stop} of {n} do not fall on the kernel's "
                             f"{bn}-row blocks")
        k = half * 2
        full = (stop - start) // bn
        parts = []
        if full:
            parts.append(block_codes(packed[start:start + full * bn].reshape(full, k, bn // 2),
                                     self.full_block == "split"))
        tail = stop - start - full * bn
        if tail:
            b = packed[stop - tail:stop].reshape(k, tail // 2)
            parts.append(torch.stack([b & 0xF, b >> 4], -1).reshape(k, tail).t())
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


    def codes_t_(self, packed: torch.Tensor, start: int, stop: int, out: torch.Tensor
                 ) -> torch.Tensor:
        """The codes of rows ``start:stop`` written transposed into ``out`` (float, [K,
        stop-start]): what :meth:`codes` returns, ``.t()``, without the row-major copy. A block
        is stored K-major, so each nibble plane lands in ``out`` with one strided copy; the
        prefill path dequantizes in this orientation."""
        n, half = packed.shape
        k = half * 2
        bn = self.block_n
        if start % bn or (stop % bn and stop != n) or not 0 <= start < stop <= n:
            raise ValueError(f"rows {start}:{stop} of {n} do not fall on the kernel's "
                             f"{bn}-row blocks")
        if out.shape != (k, stop - start):
            raise ValueError(f"out is {list(out.shape)}, expected [{k}, {stop - start}]")
        full = (stop - start) // bn
        if full:
            b = packed[start:start + full * bn].view(full, k, bn // 2).permute(1, 0, 2)
            dst = out[:, :full * bn].unflatten(1, (full, bn))  # [K, block, row in block]
            if self.full_block == "split":
                dst[..., : bn // 2].copy_(b & 0xF)
                dst[..., bn // 2:].copy_(b >> 4)
            else:
                pairs = dst.unflatten(2, (bn // 2, 2))
                pairs[..., 0].copy_(b & 0xF)
                pairs[..., 1].copy_(b >> 4)
        tail = stop - start - full * bn
        if tail:
            b = packed[stop - tail:stop].view(k, tail // 2)
            pairs = out[:, full * bn:].unflatten(1, (tail // 2, 2))
            pairs[..., 0].copy_(b & 0xF)
            pairs[..., 1].copy_(b >> 4)
        return out


def block_codes(blocks: torch.Tensor, split: bool) -> torch.Tensor:
    """Codes uint8 [B·bn, K] of whole kernel blocks (``blocks``: uint8 [B, K, bn/2], each block
    stored K-major): a ``split`` block holds rows ``0..bn/2`` in its low nibbles and the rest
    in its high ones, a ``paired`` block rows ``2i`` and ``2i + 1`` in one byte."""
    full, k, half = blocks.shape
    lo, hi = blocks & 0xF, blocks >> 4
    c = torch.cat([lo, hi], -1) if split else torch.stack([lo, hi], -1).reshape(full, k, 2 * half)
    return c.transpose(1, 2).reshape(full * 2 * half, k)


_CANDIDATES = tuple(KernelLayout("?", bn, how) for bn in (16, 32, 64, 128, 256)
                    for how in ("split", "paired"))
_EXPECTED = {"AVX512": (64, "split"), "AVX2": (32, "split"), "DEFAULT": (32, "paired")}


def torch_pack(codes: torch.Tensor) -> torch.Tensor:
    """torch's own packer for the tinygemm CPU kernel (the authority on the kernel layout)."""
    # the second argument (innerKTiles) only matters for the CUDA layout; the CPU packer ignores it
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)


@functools.cache
def kernel_layout() -> KernelLayout:
    """The kernel layout of this process's ISA path, checked against torch's packer.

    Probes with full and partial blocks (16, 32, 48 spare rows) must all match one candidate;
    otherwise torch packs in a way this module does not describe, and reading packed bytes
    would silently scramble weights, so it raises instead.
    """
    isa = torch.backends.cpu.get_cpu_capability()
    gen = torch.Generator().manual_seed(0)
    probes = []
    for spare in (0, 16, 32, 48):
        codes = torch.randint(0, 16, (512 + spare, 6), generator=gen, dtype=torch.int32)
        probes.append((codes, torch_pack(codes)))
    matches = [c for c in _CANDIDATES
               if all(torch.equal(c.pack(codes), packed) for codes, packed in probes)]
    if len(matches) != 1:
        raise CpuQuantError(f"torch {torch.__version__} packs int4 weights for the {isa} path in a "
                            "layout cpu_quant does not know; refusing to read it (see "
                            "formats/cpu_int4/layout.py)")
    found = KernelLayout(isa, matches[0].block_n, matches[0].full_block)
    expected = _EXPECTED.get(isa)
    if expected is not None and expected != (found.block_n, found.full_block):
        raise CpuQuantError(f"torch {torch.__version__} on {isa}: kernel layout "
                            f"{found.block_n}-row {found.full_block} blocks, expected "
                            f"{expected[0]}-row {expected[1]}; refusing to read it")
    return found


def _chunk_rows(k: int, block_n: int, weights: int = CHUNK_WEIGHTS) -> int:
    return max(block_n, (weights // max(k, 1)) // block_n * block_n)


def repack_to_kernel_(weight_packed: torch.Tensor, name: str = "module") -> torch.Tensor:
    """Turn a portable ``weight_packed`` [N, K/2] into the kernel layout, in place.

    Both layouts have the same size, and a kernel block depends only on its own rows, so the
    conversion walks chunks of whole blocks: the only extra memory is one chunk's int32 codes.
    """
    n, half = weight_packed.shape
    if n % KERNEL_ROW_MULTIPLE:
        raise CpuQuantError(f"{name}: out-features {n} is not a multiple of {KERNEL_ROW_MULTIPLE}; "
                            "the tinygemm kernel's output blocks cannot tile it")
    layout = kernel_layout()
    rows = _chunk_rows(half * 2, layout.block_n)
    for r in range(0, n, rows):
        chunk = weight_packed[r:r + rows]
        chunk.copy_(torch_pack(unpack_codes(chunk)))
    return weight_packed


def scale_zero_storage(n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's bf16 [K/g, N, 2] tensor, and two [N, K/g] views of it (scales, zeros).

    Loading the portable ``weight_scale``/``weight_zero`` into the views fills the kernel's tensor
    directly, with no second copy.
    """
    storage = torch.zeros(k // group, n, 2, dtype=torch.bfloat16)
    return storage, storage[..., 0].t(), storage[..., 1].t()


def dequantize_kernel_rows(packed: torch.Tensor, scale_zeros: torch.Tensor, group: int,
                           start: int, stop: int, layout: KernelLayout | None = None
                           ) -> torch.Tensor:
    """bf16 weight rows ``start:stop`` read directly from the kernel layout.

    Same arithmetic as the kernel (float32 ``(q - 8) * s + z``), rounded once to bf16, so it
    equals the bf16 rounding of :func:`dequantize_cpu_int4`.
    """
    layout = layout or kernel_layout()
    if packed.shape[1] * 2 != group * scale_zeros.shape[0]:
        raise ValueError(f"{scale_zeros.shape[0]} groups of {group} do not make the weight's "
                         f"{packed.shape[1] * 2} in-features")
    return dequantize_codes(layout.codes(packed, start, stop), scale_zeros[:, start:stop])


def dequantize_codes(codes: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """bf16 rows [R, K] of ``codes`` (uint8 [R, K]) with their scale/zero pairs
    (``scale_zeros``: bf16 [K/g, R, 2]): ``(q - 8) * s + z`` in float32, rounded once."""
    rows, k = codes.shape
    sz = scale_zeros.to(torch.float32).transpose(0, 1).unsqueeze(-1)  # [r, G, 2, 1]
    w = codes.to(torch.float32).reshape(rows, scale_zeros.shape[0], -1).sub_(QZERO)
    return w.mul_(sz[:, :, 0]).add_(sz[:, :, 1]).to(torch.bfloat16).reshape(rows, k)


def dequantize_kernel_t_(packed: torch.Tensor, scale_zeros: torch.Tensor, group: int,
                         start: int, stop: int, out: torch.Tensor,
                         layout: KernelLayout | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of the weight, transposed, in float32 (``out``: contiguous [K,
    stop-start]), read from the kernel layout: ``(q - 8) * s + z`` as the kernel computes it
    (the product exact, the sum rounded once), so ``out.t()`` equals
    :func:`dequantize_kernel_rows` before its bf16 rounding. The fast path of the prefill: no
    allocation of the weight's size, and the [K, N] orientation the float32 GEMM takes as is."""
    layout = layout or kernel_layout()
    k, rows = out.shape
    layout.codes_t_(packed, start, stop, out)
    sz = scale_zeros[:, start:stop].to(torch.float32).unsqueeze(1)  # [G, 1, rows, 2]
    w = out.view(k // group, group, rows)
    return w.sub_(QZERO).mul_(sz[..., 0]).add_(sz[..., 1]).view(k, rows)


def dequantize_chunks(packed: torch.Tensor, weights: int = CHUNK_WEIGHTS) -> list[tuple[int, int]]:
    """Row ranges (whole kernel blocks) of about ``weights`` weights each."""
    n, half = packed.shape
    rows = _chunk_rows(half * 2, kernel_layout().block_n, weights)
    return [(r, min(n, r + rows)) for r in range(0, n, rows)]
