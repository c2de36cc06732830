"""Hessians of the linears' inputs: ``H = 2 XᵀX / n``, summed over the calibration batches.

:func:`gram` is the product (symmetric blocks only, bf16 operands with float32 sums);
:class:`GramSum` adds one batch's product after another, in batch order (the one order every
run uses: a distributed run reproduces it across its ranks, ``distributed.py``);
:class:`HessianAccumulator` sums it over a layer's forward passes with pre-hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from .streaming import LayerDone


@contextmanager
def bf16_products():
    """float32 matmuls computed by oneDNN from bf16 operands with float32 accumulation.

    The calibration activations are bf16 values already (the model runs in bf16), so rounding
    the operands to bf16 loses nothing; every product is exact and only the summation order
    differs from a float32 GEMM. Measured on XᵀX of 4096 x 1536: max error against float64
    1.3e-6 of the largest entry (float32 GEMM: 3.9e-7), at 0.46x its CPU time. The Hessians
    are the largest compute of a layer, so this is the one place it is used."""
    mm = torch.backends.mkldnn.matmul
    previous = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = previous


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
GRAM_ROWS = 2048  # rows per bf16 product of :func:`gram`, summed in float32


def gram(x: torch.Tensor) -> torch.Tensor:
    """XᵀX (float32) of x [rows, K], computing only the blocks on and above the diagonal.

    XᵀX is symmetric, and a GEMM does not know it: products of column blocks ``i <= j`` are
    computed and the lower blocks are their transposes, so about ``(n+1)/2n`` of the GEMM's
    work for ``n`` blocks (measured for 4096 x 1536 on 2 cores: 0.73x the time of ``x.t() @
    x``).

    A bf16 ``x`` (the calibration activations of a bf16 model) is multiplied in bf16: every
    product is exact and oneDNN accumulates in float32, but the GEMM rounds its output to bf16
    (torch 2.13 has no bf16-in, float32-out GEMM on the CPU). So the rows go in slabs of
    GRAM_ROWS, each slab's product is rounded once, and the slabs are summed in float32. The
    roundings are unbiased and independent, so over a layer's 65,536 calibration tokens the
    Hessian is within about 1e-3 of its largest entry (each diagonal entry within about 1e-3
    of itself; the test allows 1.5e-3 and 2e-3), far below the calibration sample's own noise;
    on an AMD EPYC with AVX-512 bf16 (2 cores) it takes 0.62x (K = 576) and 0.56x (K = 1536)
    the time of the float32 product. Any other dtype is
    multiplied in float32, as accurately as a float32 GEMM; the summation order, and so the
    last bits, depend only on the shapes."""
    k = x.shape[1]
    n = min(-(-k // GRAM_BLOCK), GRAM_MAX_BLOCKS)
    width = -(-k // n)
    if x.dtype == torch.bfloat16:
        slabs = torch.split(x, GRAM_ROWS)
    else:
        slabs = (x.to(torch.float32),)
    sums: dict[tuple[int, int], torch.Tensor] = {}  # (i, j) -> block, contiguous float32
    with bf16_products():
        for slab in slabs:
            cols = [slab[:, a:a + width] for a in range(0, k, width)]
            for i, xi in enumerate(cols):
                for j in range(i, len(cols)):
                    block = xi.t() @ cols[j]
                    if (i, j) in sums:
                        sums[i, j].add_(block)
                    else:
                        sums[i, j] = block.to(torch.float32)
    out = torch.empty(k, k, dtype=torch.float32)
    for (i, j), block in sums.items():
        a, b = i * width, j * width
        out[a:a + block.shape[0], b:b + block.shape[1]] = block
        if j != i:  # the lower blocks mirror the upper ones
            out[b:b + block.shape[1], a:a + block.shape[0]] = block.t()
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

    def add(self, xtx: torch.Tensor, rows: int) -> None:
        """One batch's XᵀX (not modified afterwards by the caller) and its row count."""
        self.total.add_(xtx)
        self.rows += rows

    def hessian(self) -> torch.Tensor | None:
        """``2 Σ XᵀX / n``; None when no batch reached the linear."""
        return 2.0 * self.total / self.rows if self.rows else None


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
