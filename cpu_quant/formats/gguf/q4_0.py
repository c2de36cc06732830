"""llama.cpp's Q4_0 quant type: blocks of 32 weights, one fp16 scale ``d`` and 16 bytes of
nibbles, ``w = (q - 8) * d``: the same grid as GPTQ's symmetric codes."""

from __future__ import annotations

import gguf
import torch

from ...core.errors import CpuQuantError
from ...core.grid import GroupQuant

BLOCK = 32  # Q4_0 elements per block
BLOCK_BYTES = 18  # fp16 d + 16 bytes of nibbles
FP16_MAX = 65504.0
Q4_0 = gguf.GGMLQuantizationType.Q4_0
F32 = gguf.GGMLQuantizationType.F32


def fp16_scales(scales: torch.Tensor, module: str) -> torch.Tensor:
    """float32 (bf16-valued) scales -> float16, exactly, or a one-line error naming ``module``."""
    half = scales.to(torch.float16)
    bad = ~torch.isfinite(half) | (half.to(torch.float32) != scales)
    if bool(bad.any()):
        value = float(scales[bad].flatten()[0])
        raise CpuQuantError(f"{module}: {int(bad.sum())} scale(s) not exact in fp16 (e.g. {value:.6g}); "
                            f"GGUF Q4_0 stores fp16 scales, exact for |d| in [6.1e-05, 65504]")
    return half


def as_blocks_of_32(gq: GroupQuant) -> GroupQuant:
    """``gq`` on Q4_0's blocks: the same codes, each group's scale repeated in its blocks."""
    if gq.zeros is not None:
        raise CpuQuantError("Q4_0 holds only the symmetric grid (zeros given)")
    n, k = gq.shape
    if k % BLOCK or gq.group_size % BLOCK:
        raise CpuQuantError(f"Q4_0 needs in-features and group multiples of {BLOCK} "
                            f"(K={k}, group {gq.group_size})")
    scales = gq.scales.repeat_interleave(gq.group_size // BLOCK, dim=1)
    return GroupQuant(gq.codes, scales.contiguous(), None, BLOCK)


def pack_q4_0(gq: GroupQuant, module: str = "module") -> torch.Tensor:
    """A symmetric :class:`GroupQuant` [N, K] -> Q4_0 blocks, uint8 [N, K/32 * 18]."""
    b = as_blocks_of_32(gq)
    n, k = b.shape
    d = fp16_scales(b.scales, module).contiguous().view(torch.uint8).view(n, k // BLOCK, 2)
    q = b.codes.to(torch.uint8).view(n, k // BLOCK, BLOCK)
    qs = q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return torch.cat([d, qs], dim=-1).reshape(n, k // BLOCK * BLOCK_BYTES).contiguous()


def unpack_q4_0(blocks: torch.Tensor) -> GroupQuant:
    """Q4_0 blocks uint8 [N, K/32 * 18] -> a group-32 :class:`GroupQuant` (codes and scales)."""
    n, nbytes = blocks.shape
    if nbytes % BLOCK_BYTES:
        raise CpuQuantError(f"Q4_0 row of {nbytes} bytes is not whole blocks of {BLOCK_BYTES}")
    raw = blocks.reshape(n, nbytes // BLOCK_BYTES, BLOCK_BYTES)
    d = raw[..., :2].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)
    qs = raw[..., 2:]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, -1)
    return GroupQuant(codes.contiguous(), d.contiguous(), None, BLOCK)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks -> float32 [N, K]: ``(q - 8) * d`` (the reference gguf-py is held to)."""
    return unpack_q4_0(blocks).dequantize()
