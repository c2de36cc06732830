"""GGUF block-grid quant types (Q4_K, Q5_K, Q6_K, IQ4_NL, Q5_0, Q5_1, Q8_0): our packed bytes
held to gguf-py's ``dequantize`` bit for bit, and the round trip through ``unpack`` exact."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from cpu_quant.core.block_grid import BlockQuant, BlockScales, fp16_exact
from cpu_quant.core.errors import CpuQuantError
from cpu_quant.formats.gguf import block_types
from cpu_quant.formats.gguf.blocks import QUANT_TYPES, QuantType

TYPES = sorted(QUANT_TYPES.values(), key=lambda t: t.name)
IDS = [t.name for t in TYPES]


def random_result(qt: QuantType, n: int, k: int, seed: int, kind: str = "random") -> BlockQuant:
    """Codes and stored fields anywhere in their ranges: ``kind`` "random" (scales of either
    sign, magnitudes from 1e-7 to 1e3), "zero" (all fields 0), "limits" (float16's extremes:
    ±65504, the smallest subnormal, the largest codes and sub-scales)."""
    grid = qt.grid
    g = torch.Generator().manual_seed(seed)
    nb, ns = k // grid.block, k // grid.super_block
    codes = torch.randint(0, len(grid.levels), (n, k), generator=g, dtype=torch.uint8)

    def half(shape):
        mag = 10.0 ** (torch.rand(shape, generator=g) * 10 - 7)
        sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
        return fp16_exact(mag * sign)

    lo, hi = grid.sub_scale_range if grid.scale_bits else (0, 0)

    def ints(shape):
        return torch.randint(lo, hi + 1, shape, generator=g).to(torch.float32)

    d = half((n, ns))
    sc = ints((n, nb)) if grid.scale_bits else None
    dmin = half((n, ns)) if grid.has_min else None
    m = torch.randint(0, hi + 1, (n, nb), generator=g).to(torch.float32) \
        if grid.has_min and grid.scale_bits else None
    if kind == "zero":
        codes.zero_()
        d, dmin = torch.zeros_like(d), None if dmin is None else torch.zeros_like(dmin)
    elif kind == "limits":
        extremes = torch.tensor([65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -24), 0.0])
        d = extremes[torch.arange(n * ns) % 5].reshape(n, ns)
        codes = torch.full_like(codes, len(grid.levels) - 1)
        codes[::2] = 0
        if sc is not None:
            sc = torch.where(torch.arange(n * nb).reshape(n, nb) % 2 == 0, float(hi), float(lo))
        if dmin is not None:
            dmin = extremes.flip(0)[torch.arange(n * ns) % 5].reshape(n, ns)
        if m is not None:
            m = torch.full_like(m, float(hi))
    return BlockQuant(codes, BlockScales(grid, d, sc, dmin, m))


def theirs(qt: QuantType, blocks: torch.Tensor) -> np.ndarray:
    return gguf.quants.dequantize(blocks.numpy(), qt.qtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
@pytest.mark.parametrize("kind", ["random", "zero", "limits"])
def test_gguf_py_dequantizes_our_bytes_to_our_values_bit_for_bit(qt: QuantType, kind: str) -> None:
    n, k = 12, 512
    seed = IDS.index(qt.name) * 3 + ["random", "zero", "limits"].index(kind)
    bq = random_result(qt, n, k, seed=seed, kind=kind)
    blocks = qt.pack(bq)
    assert blocks.dtype == torch.uint8
    assert blocks.shape == (n, k // qt.elements * qt.block_bytes)
    ours = bq.dequantize().numpy()
    got = theirs(qt, blocks)
    if kind != "limits":  # ±65504 * 127 * 113 overflows to inf in both, and inf - inf is NaN
        assert np.isfinite(ours).all()
    assert same_bits(ours, got), qt.name
    back = qt.unpack(blocks)
    assert torch.equal(back.codes, bq.codes)
    assert same_bits(back.dequantize().numpy(), got)
    assert torch.equal(qt.pack(back), blocks)  # the bytes are a function of the fields


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
def test_each_element_lands_where_ggml_reads_it(qt: QuantType) -> None:
    """One non-zero code at a time, in every position of a block, read back by gguf-py at the
    same position: the bit order is ggml's, not merely self-consistent."""
    grid = qt.grid
    k = qt.elements
    base = random_result(qt, 1, k, seed=3)
    fixed = BlockScales(grid, torch.ones_like(base.fixed.d),
                        None if base.fixed.sc is None else torch.ones_like(base.fixed.sc),
                        None if base.fixed.dmin is None else torch.zeros_like(base.fixed.dmin),
                        None if base.fixed.m is None else torch.zeros_like(base.fixed.m))
    zero_code = int(np.argmin(np.abs(np.array(grid.levels))))
    top = len(grid.levels) - 1
    for pos in range(k):
        codes = torch.full((1, k), zero_code, dtype=torch.uint8)
        codes[0, pos] = top
        got = theirs(qt, qt.pack(BlockQuant(codes, fixed)))[0]
        assert got[pos] == grid.levels[top], (qt.name, pos)
        others = np.delete(got, pos)
        assert np.all(others == grid.levels[zero_code]), (qt.name, pos)


@pytest.mark.parametrize("qt", [t for t in TYPES if t.grid.scale_bits], ids=lambda t: t.name)
def test_each_sub_scale_lands_where_ggml_reads_it(qt: QuantType) -> None:
    grid = qt.grid
    k = qt.elements
    nb = k // grid.block
    for j in range(nb):
        sc = torch.zeros(1, nb)
        sc[0, j] = 5.0
        m = None if not grid.has_min else torch.zeros(1, nb)
        if m is not None:
            m[0, (j + 1) % nb] = 7.0
        fixed = BlockScales(grid, torch.ones(1, 1), sc, None if m is None else torch.ones(1, 1), m)
        codes = torch.full((1, k), len(grid.levels) - 1, dtype=torch.uint8)
        got = theirs(qt, qt.pack(BlockQuant(codes, fixed)))[0].reshape(nb, grid.block)
        want = BlockQuant(codes, fixed).dequantize().numpy().reshape(nb, grid.block)
        assert np.array_equal(got, want), (qt.name, j)
        assert np.all(got[j] == 5.0 * grid.levels[-1])
        if m is not None:  # the sub-min of the next block, whose sub-scale is 0
            assert np.all(got[(j + 1) % nb] == -7.0)


def test_a_value_fp16_cannot_hold_is_refused() -> None:
    qt = QUANT_TYPES[gguf.GGMLQuantizationType.IQ4_NL]
    bq = random_result(qt, 2, 64, seed=1)
    bq.fixed.d[0, 0] = 1.0 + 2.0 ** -15
    with pytest.raises(CpuQuantError, match="not exact in float16"):
        qt.pack(bq)


def test_a_sub_scale_out_of_range_is_refused() -> None:
    qt = QUANT_TYPES[gguf.GGMLQuantizationType.Q4_K]
    bq = random_result(qt, 2, 256, seed=1)
    bq.fixed.sc[0, 0] = 64.0
    with pytest.raises(CpuQuantError, match="not an integer in"):
        qt.pack(bq)


def test_a_row_of_partial_blocks_is_refused() -> None:
    qt = QUANT_TYPES[gguf.GGMLQuantizationType.Q6_K]
    with pytest.raises(CpuQuantError, match="not whole blocks"):
        qt.unpack(torch.zeros(2, 211, dtype=torch.uint8))


def test_every_type_module_is_registered() -> None:
    assert {t.name for t in TYPES} == set(block_types.NAMES)
