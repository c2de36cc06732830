"""What the block-grid quant types of this package share: the :class:`QuantType` record each
type module declares, the registry of them, and the byte helpers (float16 fields, nibble and
bit planes) their packers are written with. The layouts themselves are in each type's module
docstring (``q4_k.py``, ``q5_k.py``, ``q6_k.py``, ``iq4_nl.py``, ``q5_0.py``, ``q5_1.py``,
``q8_0.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import torch

from ...core.block_grid import BlockGrid, BlockQuant
from ...core.errors import CpuQuantError


@dataclass(frozen=True)
class QuantType:
    """One ggml quant type written from a :class:`BlockQuant`: its grid, its block of
    ``elements`` weights in ``block_bytes`` bytes, and its packer/unpacker between a
    :class:`BlockQuant` [N, K] and uint8 [N, K / elements * block_bytes]."""

    qtype: gguf.GGMLQuantizationType
    grid: BlockGrid
    elements: int
    block_bytes: int
    pack: Callable[[BlockQuant], torch.Tensor]
    unpack: Callable[[torch.Tensor], BlockQuant]

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.elements


QUANT_TYPES: dict[gguf.GGMLQuantizationType, QuantType] = {}


def register(t: QuantType) -> QuantType:
    size = gguf.GGML_QUANT_SIZES[t.qtype]
    assert size == (t.elements, t.block_bytes), (t.qtype, size)
    QUANT_TYPES[t.qtype] = t
    return t


def check_codes(bq: BlockQuant, qt: QuantType) -> tuple[int, int]:
    """(N, super-blocks per row) of a result on ``qt``'s grid, or a one-line error."""
    if bq.grid != qt.grid:
        raise CpuQuantError(f"{qt.name}: the result is on another grid")
    n, k = bq.shape
    if k % qt.elements:
        raise CpuQuantError(f"{qt.name}: in-features {k} are not whole blocks of {qt.elements}")
    return n, k // qt.elements


def split_rows(blocks: torch.Tensor, qt: QuantType) -> tuple[int, int, torch.Tensor]:
    """uint8 [N, bytes] -> (N, blocks per row, uint8 [N, blocks, block_bytes])."""
    n, nbytes = blocks.shape
    if nbytes % qt.block_bytes:
        raise CpuQuantError(f"{qt.name} row of {nbytes} bytes is not whole blocks of "
                            f"{qt.block_bytes}")
    nb = nbytes // qt.block_bytes
    return n, nb, blocks.reshape(n, nb, qt.block_bytes)


def fp16_bytes(x: torch.Tensor, what: str) -> torch.Tensor:
    """float32 values that float16 holds exactly -> their little-endian bytes [..., 2]."""
    half = x.to(torch.float16)
    if not bool((half.to(torch.float32) == x).all()):
        raise CpuQuantError(f"{what}: a value is not exact in float16")
    return half.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def fp16_values(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 bytes [..., 2] -> float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def integers(x: torch.Tensor, lo: int, hi: int, what: str) -> torch.Tensor:
    """Integer-valued float32 within [lo, hi] -> int16, or a one-line error."""
    if not bool(((x == torch.round(x)) & (x >= lo) & (x <= hi)).all()):
        raise CpuQuantError(f"{what}: a value is not an integer in [{lo}, {hi}]")
    return x.to(torch.int16)


def halves_to_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2m] of 4-bit values -> [..., m]: byte j = element j | element j+m << 4."""
    m = q.shape[-1] // 2
    return (q[..., :m] & 0xF) | ((q[..., m:] & 0xF) << 4)


def nibbles_to_halves(b: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`halves_to_nibbles`."""
    return torch.cat([b & 0xF, b >> 4], dim=-1)


def bits_le(bits: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8m] of 0/1 -> [..., m]: bit i of byte j is element 8j + i."""
    shape = bits.shape[:-1] + (bits.shape[-1] // 8, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (bits.reshape(shape) * weights).sum(-1).to(torch.uint8)


def unbits_le(b: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`bits_le`."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(*b.shape[:-1], b.shape[-1] * 8)
