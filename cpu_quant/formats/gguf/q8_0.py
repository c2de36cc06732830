"""ggml's Q8_0: blocks of 32 signed 8-bit weights and one float16 scale.

=====  =====  ===============================================================================
bytes  field  content (one block, 34 bytes: 8.5 bits per weight)
=====  =====  ===============================================================================
0-1    d      float16 (LE)
2-33   qs     int8 element ``j`` at byte ``2 + j``
=====  =====  ===============================================================================

Dequantization (ggml ``dequantize_row_q8_0``, gguf-py ``Q8_0.dequantize_blocks``), in float32:
``w = d * q``: levels ``-128..127`` (code ``q + 128``), one float16 scale per block.
"""

from __future__ import annotations

import gguf
import torch

from ...core.block_grid import BlockGrid, BlockQuant, BlockScales
from .blocks import QuantType, check_codes, fp16_bytes, fp16_values, register, split_rows

GRID = BlockGrid(levels=tuple(float(i) for i in range(-128, 128)), block=32, super_block=32,
                 scale_bits=0)


def pack_q8_0(bq: BlockQuant) -> torch.Tensor:
    n, nb = check_codes(bq, Q8_0)
    d = fp16_bytes(bq.fixed.d, "Q8_0 d")
    qs = (bq.codes.view(n, nb, 32).to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    return torch.cat([d, qs], dim=-1).reshape(n, -1).contiguous()


def unpack_q8_0(blocks: torch.Tensor) -> BlockQuant:
    n, nb, raw = split_rows(blocks, Q8_0)
    codes = (raw[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return BlockQuant(codes.reshape(n, nb * 32).contiguous(),
                      BlockScales(GRID, fp16_values(raw[..., :2]), None, None, None))


Q8_0 = register(QuantType(gguf.GGMLQuantizationType.Q8_0, GRID, 32, 34, pack_q8_0, unpack_q8_0))
