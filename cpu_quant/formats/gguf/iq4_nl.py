"""ggml's IQ4_NL: blocks of 32 weights on a fixed non-uniform table of 16 levels.

=====  =====  ===============================================================================
bytes  field  content (one block, 18 bytes: 4.5 bits per weight)
=====  =====  ===============================================================================
0-1    d      float16 (LE)
2-17   qs     byte ``2 + j`` holds element ``j``'s index in its low nibble and element
              ``j + 16``'s in its high nibble (j = 0..15), as Q4_0's
=====  =====  ===============================================================================

Dequantization (ggml ``dequantize_row_iq4_nl``, gguf-py ``IQ4_NL.dequantize_blocks``), in
float32: ``w = d * kvalues[q]`` with ggml's ``kvalues_iq4nl`` (:data:`KVALUES`), denser near
zero where weights are: the block grid with those levels, one float16 scale per block.
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
    nibbles_to_halves,
    register,
    split_rows,
)

# ggml-common.h kvalues_iq4nl (gguf-py IQ4_NL.kvalues)
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GRID = BlockGrid(levels=tuple(float(v) for v in KVALUES), block=32, super_block=32, scale_bits=0)


def pack_iq4_nl(bq: BlockQuant) -> torch.Tensor:
    n, nb = check_codes(bq, IQ4_NL)
    d = fp16_bytes(bq.fixed.d, "IQ4_NL d")
    qs = halves_to_nibbles(bq.codes.view(n, nb, 32))
    return torch.cat([d, qs], dim=-1).reshape(n, -1).contiguous()


def unpack_iq4_nl(blocks: torch.Tensor) -> BlockQuant:
    n, nb, raw = split_rows(blocks, IQ4_NL)
    codes = nibbles_to_halves(raw[..., 2:]).reshape(n, nb * 32)
    return BlockQuant(codes.contiguous(),
                      BlockScales(GRID, fp16_values(raw[..., :2]), None, None, None))


IQ4_NL = register(QuantType(gguf.GGMLQuantizationType.IQ4_NL, GRID, 32, 18, pack_iq4_nl,
                            unpack_iq4_nl))
