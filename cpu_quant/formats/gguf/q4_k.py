"""ggml's Q4_K: super-blocks of 256 weights, eight sub-blocks of 32 with 6-bit scales and mins.

=====  =====  =============================================================================
bytes  field  content (one super-block, 144 bytes: 4.5 bits per weight)
=====  =====  =============================================================================
0-1    d      float16 (LE): the super-block's scale of the sub-scales
2-3    dmin   float16 (LE): the super-block's scale of the sub-mins
4-15   scales eight 6-bit sub-scales ``sc[j]`` and eight 6-bit sub-mins ``m[j]``: for j < 4,
              byte ``4+j`` = ``sc[j] | (sc[j+4] >> 4) << 6``, byte ``8+j`` =
              ``m[j] | (m[j+4] >> 4) << 6``, byte ``12+j`` = ``(sc[j+4] & 15) |
              (m[j+4] & 15) << 4``
16-143 qs     four chunks of 32 bytes; byte ``l`` of chunk ``c`` holds sub-block ``2c``'s
              element ``l`` in its low nibble and sub-block ``2c+1``'s in its high nibble
=====  =====  =============================================================================

Dequantization (ggml ``dequantize_row_q4_K``, gguf-py ``Q4_K.dequantize_blocks``), in float32:
``w = (d * sc[j]) * q - (dmin * m[j])`` for ``q ∈ [0, 15]`` of sub-block ``j``: the block grid
with levels ``0..15``, unsigned 6-bit sub-scales and sub-mins (``core/block_grid.py``).
"""

from __future__ import annotations

import gguf
import torch

from ...core.block_grid import BlockGrid, BlockQuant, BlockScales
from .blocks import (
    QuantType,
    check_codes,
    fp16_bytes,
    fp16_values,
    halves_to_nibbles,
    integers,
    nibbles_to_halves,
    register,
    split_rows,
)

GRID = BlockGrid(levels=tuple(float(i) for i in range(16)), block=32, super_block=256,
                 scale_bits=6, has_min=True)


def pack_scales_6bit(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int16 [..., 8] sub-scales and sub-mins (0..63) -> the 12 scale bytes [..., 12]."""
    lo_sc, hi_sc = sc[..., :4], sc[..., 4:]
    lo_m, hi_m = m[..., :4], m[..., 4:]
    out = torch.cat([lo_sc | ((hi_sc >> 4) << 6), lo_m | ((hi_m >> 4) << 6),
                     (hi_sc & 15) | ((hi_m & 15) << 4)], dim=-1)
    return out.to(torch.uint8)


def unpack_scales_6bit(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes [..., 12] -> (sub-scales, sub-mins), float32 [..., 8]."""
    b = b.to(torch.int16)
    s, mm, low = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([s & 63, (low & 15) | ((s >> 6) << 4)], dim=-1)
    m = torch.cat([mm & 63, (low >> 4) | ((mm >> 6) << 4)], dim=-1)
    return sc.to(torch.float32), m.to(torch.float32)


def super_fields(bq: BlockQuant, qt: QuantType) -> tuple[int, int, torch.Tensor]:
    """(N, super-blocks per row, the first 16 bytes of every super-block: d, dmin, scales)."""
    n, ns = check_codes(bq, qt)
    f = bq.fixed
    d = fp16_bytes(f.d, f"{qt.name} d")
    dmin = fp16_bytes(f.dmin, f"{qt.name} dmin")
    sc = integers(f.sc, 0, 63, f"{qt.name} sub-scale").view(n, ns, 8)
    m = integers(f.m, 0, 63, f"{qt.name} sub-min").view(n, ns, 8)
    return n, ns, torch.cat([d, dmin, pack_scales_6bit(sc, m)], dim=-1)


def low_nibbles(codes: torch.Tensor, n: int, ns: int) -> torch.Tensor:
    """The ``qs`` bytes of codes [N, K] (their low 4 bits): [N, ns, 128]."""
    q = (codes & 15).view(n, ns, 4, 64)  # chunk c: sub-blocks 2c, 2c+1
    return halves_to_nibbles(q).reshape(n, ns, 128)


def unpack_super(raw: torch.Tensor, grid: BlockGrid) -> BlockScales:
    n, ns = raw.shape[:2]
    sc, m = unpack_scales_6bit(raw[..., 4:16])
    return BlockScales(grid, fp16_values(raw[..., 0:2]), sc.reshape(n, ns * 8),
                       fp16_values(raw[..., 2:4]), m.reshape(n, ns * 8))


def pack_q4_k(bq: BlockQuant) -> torch.Tensor:
    """A :class:`BlockQuant` on :data:`GRID` [N, K] -> Q4_K super-blocks uint8 [N, K/256*144]."""
    n, ns, head = super_fields(bq, Q4_K)
    return torch.cat([head, low_nibbles(bq.codes, n, ns)], dim=-1).reshape(n, -1).contiguous()


def unpack_q4_k(blocks: torch.Tensor) -> BlockQuant:
    n, ns, raw = split_rows(blocks, Q4_K)
    codes = nibbles_to_halves(raw[..., 16:].reshape(n, ns, 4, 32)).reshape(n, ns * 256)
    return BlockQuant(codes.contiguous(), unpack_super(raw, GRID))


Q4_K = register(QuantType(gguf.GGMLQuantizationType.Q4_K, GRID, 256, 144, pack_q4_k, unpack_q4_k))
