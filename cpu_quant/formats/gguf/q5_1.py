"""ggml's Q5_1: blocks of 32 weights, 5-bit codes, a float16 scale and a float16 min.

=====  =====  ===============================================================================
bytes  field  content (one block, 24 bytes: 6 bits per weight)
=====  =====  ===============================================================================
0-1    d      float16 (LE)
2-3    m      float16 (LE)
4-7    qh     bit ``j`` (little-endian 32-bit word) is bit 4 of element ``j``
8-23   qs     the low 4 bits, as Q5_0's
=====  =====  ===============================================================================

Dequantization (ggml ``dequantize_row_q5_1``, gguf-py ``Q5_1.dequantize_blocks``), in float32:
``w = d * q + m``: levels ``0..31``, a float16 scale and min per block (the block grid's
``dmin`` without sub-mins is the min itself).
"""

from __future__ import annotations

import gguf
import torch

from ...core.block_grid import BlockGrid, BlockQuant, BlockScales
from .blocks import QuantType, check_codes, fp16_bytes, fp16_values, register, split_rows
from .q5_0 import pack_5bit, unpack_5bit

GRID = BlockGrid(levels=tuple(float(i) for i in range(32)), block=32, super_block=32,
                 scale_bits=0, has_min=True)


def pack_q5_1(bq: BlockQuant) -> torch.Tensor:
    n, nb = check_codes(bq, Q5_1)
    d = fp16_bytes(bq.fixed.d, "Q5_1 d")
    m = fp16_bytes(bq.fixed.dmin, "Q5_1 m")
    return torch.cat([d, m, pack_5bit(bq.codes, n, nb)], dim=-1).reshape(n, -1).contiguous()


def unpack_q5_1(blocks: torch.Tensor) -> BlockQuant:
    n, nb, raw = split_rows(blocks, Q5_1)
    fixed = BlockScales(GRID, fp16_values(raw[..., :2]), None, fp16_values(raw[..., 2:4]), None)
    return BlockQuant(unpack_5bit(raw[..., 4:]).contiguous(), fixed)


Q5_1 = register(QuantType(gguf.GGMLQuantizationType.Q5_1, GRID, 32, 24, pack_q5_1, unpack_q5_1))
