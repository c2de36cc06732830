"""Hessians of the linears' inputs: ``H = 2 XᵀX / n``, summed over the calibration batches.

:func:`gram` is the product (symmetric blocks only, exact integer sums in float64);
:class:`GramSum` adds one batch's product after another, in batch order (the one order every
run uses: a distributed run reproduces it across its ranks, ``distributed.py``);
:class:`HessianAccumulator` sums it over a layer's forward passes with pre-hooks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .streaming import LayerDone


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` as vLLM's W4A8 kernel sees it: each row (token) quantized to symmetric int8,
    ``round(x * (127 / amax))`` (the kernel multiplies by the reciprocal of its float32 scale
    ``amax / 127``; dividing by the scale rounds differently at ties), returned dequantized in
    ``x``'s dtype. In float32 this is the kernel's own arithmetic: on an AMX CPU,
    ``int4_scaled_mm_cpu`` (sgl-kernel's W4A8 GEMM in vLLM's CPU build) and this followed by a
    float32 GEMM of the dequantized weights agree after bf16 output rounding (tested where AMX
    is present). A bf16 input, as the calibration activations are, gets the dequantized values
    rounded to bf16, which the kernel does not do: ``eval --w4a8`` computes in float32."""
    amax = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12)
    q = torch.clamp(torch.round(x.float() * (127.0 / amax)), -127, 127)
    return (q * (amax / 127.0)).to(x.dtype)


def w4a8_gram(x: torch.Tensor) -> torch.Tensor:
    """:func:`gram` of the int8-per-token activations the W4A8 kernel multiplies."""
    return gram(int8_per_token(x))


GRAM_BLOCK = 256  # column-block width of :func:`gram`, for inputs up to 4 blocks wide
# past that, 4 wider blocks: each block product is a GEMM call with its own overhead, and
# Llama-3.2-1B's down projection (K = 8192) in blocks of 256 made 528 of them per slab, 5.6x
# the time of 4 blocks (14.6 s against 2.6 s for 4096 x 8192 on a 2-core AMD EPYC); the sums
# are the same bit for bit whatever the blocks (each entry is one product over the rows)
GRAM_MAX_BLOCKS = 4
# fixed point: each column is scaled by a power of two to integers of at most FIXED_BITS bits;
# the products (2 x 20 bits) of GRAM_ROWS rows (13 bits) sum to at most 2^53, so every float64
# sum of a slab is an exact integer, whatever order the GEMM adds in
FIXED_BITS = 20
GRAM_ROWS = 1 << (53 - 2 * FIXED_BITS)  # 8192 rows per float64 product at most
SLAB_ELEMENTS = 1 << 24  # and at most 128 MiB of float64 operands per slab


def column_exponents(x: torch.Tensor) -> torch.Tensor:
    """Each column's power of two above its largest magnitude (``max|x| < 2^e``; 0 for a zero
    column), from the column maxima, which are exact: the same whatever the rows are split
    into."""
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], dtype=torch.int32)
    return torch.frexp(x.abs().amax(0).to(torch.float64)).exponent


def gram(x: torch.Tensor) -> torch.Tensor:
    """XᵀX (float32) of x [rows, K], the same bits on any CPU and at any thread count.

    Each column is put in fixed point, 20 bits below the power of two above its largest value
    (:func:`column_exponents`; every bf16 value not below ``2^-13`` of that largest keeps all
    its bits), so each product is an integer of at most 40 bits and a slab of at most
    :data:`GRAM_ROWS` rows sums, in float64, to an exact integer: no GEMM kernel, ISA or thread
    split can round it differently. Each slab's sums are scaled back by powers of two (exact)
    and rounded once to float32; the slabs are added in row order. Against XᵀX in float64 the
    result is within float32 rounding plus the fixed point's (the smallest values' last bits),
    far below the calibration sample's own noise.

    Only the blocks on and above the diagonal are multiplied (XᵀX is symmetric and a GEMM does
    not know it): about ``(n+1)/2n`` of a GEMM's work for ``n`` blocks."""
    rows, k = x.shape
    n = min(-(-k // GRAM_BLOCK), GRAM_MAX_BLOCKS)
    width = -(-k // n)
    step = torch.ldexp(torch.ones(k, dtype=torch.float64), column_exponents(x) - FIXED_BITS)
    slab_rows = max(1, min(GRAM_ROWS, SLAB_ELEMENTS // max(k, 1)))
    out = torch.zeros(k, k, dtype=torch.float32)
    starts = range(0, k, width)
    for r0 in range(0, rows, slab_rows):
        # integers of at most 20 bits (division by a power of two is exact)
        ints = torch.round(x[r0:r0 + slab_rows].to(torch.float64) / step)
        cols = [ints[:, a:a + width] for a in starts]
        for i, xi in enumerate(cols):
            for j in range(i, len(cols)):
                a, b = i * width, j * width
                block = xi.t() @ cols[j]  # exact integers
                block.mul_(step[a:a + block.shape[0], None]).mul_(step[None, b:b + block.shape[1]])
                out[a:a + block.shape[0], b:b + block.shape[1]] += block.to(torch.float32)
                del block
        del ints, cols
    for i in range(len(starts)):  # the lower blocks mirror the upper ones
        for j in range(i + 1, len(starts)):
            a, b = i * width, j * width
            out[b:b + width, a:a + width] = out[a:a + width, b:b + width].t()
    return out


class GramSum:
    """Σ XᵀX (float32) and the row count over the calibration batches, added in batch order.

    The float32 sum is allocated up front, before the batches' temporaries (a long-lived block
    made among them would fragment the heap). Every Hessian of a run is summed by one of these
    (or by ``distributed.ChainedGramSum``, which makes the same additions in the same order
    across ranks), so the order of the additions, and the bits of the result, are the same
    wherever it runs."""

    def __init__(self, width: int) -> None:
        self.total = torch.zeros(width, width)
        self.rows = 0
        self.scaled = False  # the sum has become the Hessian (hessian())

    def add(self, xtx: torch.Tensor, rows: int) -> None:
        """One batch's XᵀX (not modified afterwards by the caller) and its row count."""
        if self.scaled:
            raise RuntimeError("a batch was added after the Hessian was taken")
        self.total.add_(xtx)
        self.rows += rows

    def hessian(self) -> torch.Tensor | None:
        """``2 Σ XᵀX / n``; None when no batch reached the linear. Scaled in place, once (the
        same bits as ``2.0 * total / n``): the sum becomes the Hessian, so a K x K float32
        matrix is held once, not twice. Later calls return the same tensor; adding after the
        first call is an error."""
        if not self.rows:
            return None
        if not self.scaled:
            self.total.mul_(2.0).div_(self.rows)
            self.scaled = True
        return self.total


NewGramSum = Callable[[int], GramSum]  # width -> an empty sum (GramSum or a distributed one)


class HessianAccumulator:
    """Forward pre-hooks that sum XᵀX (float32) of every hooked linear's input.

    The pass that collects Hessians has no use for what the layer computes after the last
    hooked linear has seen its input (on Llama-like layers: down_proj's product and the
    residual add, a quarter of the MLP). Once the first batch has shown that every hooked
    linear runs exactly once per call of the layer, later batches stop there
    (:class:`LayerDone`); a layer that calls a linear twice always runs to the end.
    """

    def __init__(self, modules: dict[str, nn.Module], new_sum: NewGramSum = GramSum,
                 product: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.h: dict[str, GramSum] = {}  # made when the linear first sees an input
        self.new_sum = new_sum
        self.product = product or gram  # gram, or w4a8_gram
        self.names = list(modules)
        self._calls: dict[str, int] = {}
        self._stop_early = False
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]

    def begin_batch(self) -> None:
        self._calls = {}

    def end_batch(self) -> None:
        """After a batch that ran to the end: may later batches stop early?"""
        self._stop_early = bool(self.names) and all(self._calls.get(n) == 1 for n in self.names)

    def _hook(self, name: str) -> Callable:
        def hook(module, inputs):
            x = inputs[0]
            # q/k/v (and gate/up) see the same input tensor: compute its XᵀX once.
            if self._last is not None and self._last[0] is x:
                xtx = self._last[1]
            else:
                xtx = self.product(x.reshape(-1, x.shape[-1]))
                self._last = (x, xtx)  # holding x keeps its identity unique
            if name not in self.h:
                self.h[name] = self.new_sum(x.shape[-1])
            self.h[name].add(xtx, x.numel() // x.shape[-1])
            self._calls[name] = self._calls.get(name, 0) + 1
            if self._stop_early and len(self._calls) == len(self.names):
                raise LayerDone
        return hook

    @property
    def count(self) -> dict[str, int]:
        return {name: s.rows for name, s in self.h.items()}

    def hessian(self, name: str) -> torch.Tensor | None:
        return self.h[name].hessian()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._last = None
