"""ggml's Q5_0: blocks of 32 weights, 5-bit codes, one float16 scale.

=====  =====  ===============================================================================
bytes  field  content (one block, 22 bytes: 5.5 bits per weight)
=====  =====  ===============================================================================
0-1    d      float16 (LE)
2-5    qh     bit ``j`` (little-endian 32-bit word) is bit 4 of element ``j``
6-21   qs     the low 4 bits: byte ``6 + j`` holds element ``j`` in its low nibble and
              element ``j + 16`` in its high nibble (j = 0..15)
=====  =====  ===============================================================================

Dequantization (ggml ``dequantize_row_q5_0``, gguf-py ``Q5_0.dequantize_blocks``), in float32:
``w = d * (q - 16)``: levels ``-16..15``, one float16 scale per block.
"""

from __future__ import annotations

import gguf
import torch

from ...core.block_grid import BlockGrid, BlockQuant, BlockScales
from .blocks import (
    QuantType,
    bits_le,
    check_codes,
    fp16_bytes,
    fp16_values,
    halves_to_nibbles,
    nibbles_to_halves,
    register,
    split_rows,
    unbits_le,
)

GRID = BlockGrid(levels=tuple(float(i) for i in range(-16, 16)), block=32, super_block=32,
                 scale_bits=0)


def pack_5bit(codes: torch.Tensor, n: int, nb: int) -> torch.Tensor:
    """codes [N, K] (0..31) -> ``qh`` then ``qs``, [N, K/32, 20]."""
    q = codes.view(n, nb, 32)
    return torch.cat([bits_le(q >> 4), halves_to_nibbles(q & 15)], dim=-1)


def unpack_5bit(raw: torch.Tensor) -> torch.Tensor:
    """``qh`` then ``qs`` [N, nb, 20] -> codes [N, nb * 32]."""
    n, nb = raw.shape[:2]
    return (nibbles_to_halves(raw[..., 4:]) | (unbits_le(raw[..., :4]) << 4)).reshape(n, nb * 32)


def pack_q5_0(bq: BlockQuant) -> torch.Tensor:
    n, nb = check_codes(bq, Q5_0)
    d = fp16_bytes(bq.fixed.d, "Q5_0 d")
    return torch.cat([d, pack_5bit(bq.codes, n, nb)], dim=-1).reshape(n, -1).contiguous()


def unpack_q5_0(blocks: torch.Tensor) -> BlockQuant:
    n, nb, raw = split_rows(blocks, Q5_0)
    return BlockQuant(unpack_5bit(raw[..., 2:]).contiguous(),
                      BlockScales(GRID, fp16_values(raw[..., :2]), None, None, None))


Q5_0 = register(QuantType(gguf.GGMLQuantizationType.Q5_0, GRID, 32, 22, pack_q5_0, unpack_q5_0))
