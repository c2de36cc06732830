"""ggml's Q5_K: Q4_K's super-block (``q4_k.py``) with a fifth bit per weight.

=======  =====  ===========================================================================
bytes    field  content (one super-block, 176 bytes: 5.5 bits per weight)
=======  =====  ===========================================================================
0-15     d, dmin, scales: as Q4_K's bytes 0-15
16-47    qh     bit ``j`` of byte ``l`` is bit 4 of sub-block ``j``'s element ``l``
48-175   qs     the low 4 bits, as Q4_K's ``qs``
=======  =====  ===========================================================================

Dequantization (ggml ``dequantize_row_q5_K``, gguf-py ``Q5_K.dequantize_blocks``), in float32:
``w = (d * sc[j]) * q - (dmin * m[j])`` for ``q ∈ [0, 31]``: levels ``0..31``, unsigned 6-bit
sub-scales and sub-mins.
"""

from __future__ import annotations

import gguf
import torch

from ...core.block_grid import BlockGrid, BlockQuant
from .blocks import QuantType, bits_le, nibbles_to_halves, register, split_rows, unbits_le
from .q4_k import low_nibbles, super_fields, unpack_super

GRID = BlockGrid(levels=tuple(float(i) for i in range(32)), block=32, super_block=256,
                 scale_bits=6, has_min=True)


def pack_q5_k(bq: BlockQuant) -> torch.Tensor:
    n, ns, head = super_fields(bq, Q5_K)
    high = (bq.codes >> 4).view(n, ns, 8, 32).transpose(-1, -2)  # [.., l, j]
    qh = bits_le(high.reshape(n, ns, 32, 8)).reshape(n, ns, 32)
    return torch.cat([head, qh, low_nibbles(bq.codes, n, ns)], dim=-1).reshape(n, -1).contiguous()


def unpack_q5_k(blocks: torch.Tensor) -> BlockQuant:
    n, ns, raw = split_rows(blocks, Q5_K)
    low = nibbles_to_halves(raw[..., 48:].reshape(n, ns, 4, 32)).reshape(n, ns, 8, 32)
    high = unbits_le(raw[..., 16:48].unsqueeze(-1)).reshape(n, ns, 32, 8).transpose(-1, -2)
    codes = (low | (high << 4)).reshape(n, ns * 256)
    return BlockQuant(codes.contiguous(), unpack_super(raw, GRID))


Q5_K = register(QuantType(gguf.GGMLQuantizationType.Q5_K, GRID, 256, 176, pack_q5_k, unpack_q5_k))
