"""ggml's Q6_K: super-blocks of 256 weights, sixteen sub-blocks of 16 with signed 8-bit scales.

=======  ======  ==========================================================================
bytes    field   content (one super-block, 210 bytes: 6.5625 bits per weight)
=======  ======  ==========================================================================
0-127    ql      the low 4 bits, per half ``h`` (weights ``128h .. 128h+127``) 64 bytes:
                 byte ``64h + b`` holds element ``128h + b`` in its low nibble and element
                 ``128h + 64 + b`` in its high nibble (b = 0..63)
128-191  qh      the high 2 bits, per half 32 bytes: bits ``2s, 2s+1`` of byte ``32h + l``
                 are those of element ``128h + 32s + l`` (s = 0..3)
192-207  scales  int8 sub-scale ``sc[j]`` of sub-block ``j`` (elements ``16j .. 16j+15``)
208-209  d       float16 (LE)
=======  ======  ==========================================================================

Dequantization (ggml ``dequantize_row_q6_K``, gguf-py ``Q6_K.dequantize_blocks``), in float32:
``w = (d * sc[j]) * (q - 32)`` for the 6-bit ``q``: levels ``-32..31`` (the code is
``q``), signed 8-bit sub-scales, no mins.
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

GRID = BlockGrid(levels=tuple(float(i) for i in range(-32, 32)), block=16, super_block=256,
                 scale_bits=8, signed_scales=True)


def pack_q6_k(bq: BlockQuant) -> torch.Tensor:
    n, ns = check_codes(bq, Q6_K)
    f = bq.fixed
    q = bq.codes.view(n, ns, 2, 128)
    ql = halves_to_nibbles(q & 15).reshape(n, ns, 128)
    hi = (q >> 4).view(n, ns, 2, 4, 32)
    qh = (hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6))
    sc = integers(f.sc, -128, 127, "Q6_K sub-scale").to(torch.int8).view(torch.uint8)
    d = fp16_bytes(f.d, "Q6_K d")
    out = torch.cat([ql, qh.reshape(n, ns, 64), sc.view(n, ns, 16), d], dim=-1)
    return out.reshape(n, -1).contiguous()


def unpack_q6_k(blocks: torch.Tensor) -> BlockQuant:
    n, ns, raw = split_rows(blocks, Q6_K)
    low = nibbles_to_halves(raw[..., :128].reshape(n, ns, 2, 64))  # [n, ns, 2, 128]
    qh = raw[..., 128:192].reshape(n, ns, 2, 1, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 3
    codes = (low | (high.reshape(n, ns, 2, 128) << 4)).reshape(n, ns * 256)
    sc = raw[..., 192:208].contiguous().view(torch.int8).to(torch.float32).reshape(n, ns * 16)
    fixed = BlockScales(GRID, fp16_values(raw[..., 208:210]), sc, None, None)
    return BlockQuant(codes.contiguous(), fixed)


Q6_K = register(QuantType(gguf.GGMLQuantizationType.Q6_K, GRID, 256, 210, pack_q6_k, unpack_q6_k))
