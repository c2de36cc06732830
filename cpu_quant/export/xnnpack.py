"""Phone-CPU programs: dynamic-int8-activation schemes lowered to ExecuTorch's XNNPACK.

The integer weights are decided before this module sees them (``weights``: the calibrated GPTQ
codes for 4-bit, the weighted scale search for 8-bit); ``quantize_for_xnnpack`` puts them,
unchanged, into torchao's ``IntxUnpackedToInt8Tensor`` (the tensor type torchao 0.18's
``Int8DynamicActivationIntxWeightConfig`` makes and executorch 1.5.1's XNNPACK partitioner
lowers), so nothing re-rounds them; ``readback`` checks the written program holds them.

Schemes (every ``nn.Linear``, the output head included; the embedding is a gather, which
XNNPACK does not run, so it is stored int8 per row (absmax, torchao's ``IntxWeightOnlyConfig``)
and executed by the quantized kernels as ``quantized_decomposed::embedding_byte``):

* ``8da8w``: int8 symmetric weights, one scale per output channel; activations quantized to
  int8 per token (asymmetric) at run time. XNNPACK ``qd8-f32-qc8w``. The graph is smoothed
  first (``smooth``: activation range moved into the weights, exact in float).
* ``8da4w``: int4 symmetric weights in groups (32 by default), activations as above. XNNPACK
  ``qd8-f32-qb4w``. XNNPACK takes groups that are multiples of 32 and stores block scales as
  **bf16** (``backends/xnnpack/operators/node_visitor.py``); our scales are bf16 values already
  (``quantize.grid``), and positive (``--positive-scales``), as XNNPACK requires.
* ``8w`` (int8 weight-only): refused. In executorch 1.5.1 the XNNPACK path for it exports and
  runs but returns wrong logits: a per-channel scale is lost (measured -35.9 dB against its own
  eager graph). ``probe_weight_only_int8`` really exports one small weight-only linear, runs it
  through the runtime and compares; the scheme is offered again only when that probe passes.
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass

import torch
from torch import nn

from ..core.errors import CpuQuantError
from .verify import executorch_runtime, snr_db
from .weights import LinearWeights, PhoneWeights, int8_per_channel

XNNPACK_SCHEMES = ("8da8w", "8da4w")
WEIGHT_ONLY_SCHEME = "8w"
# A program that implements its eager graph differs from it by accumulation order only;
# the weight-only bug shows up below 0 dB. Half-way, on a log scale, separates them.
PROBE_MIN_SNR_DB = 30.0


# the activation quantization each scheme's linears apply (torchao's names)
ACTIVATION = {"8da8w": "int8_asym_per_token", "8da4w": "int8_asym_per_token",
              WEIGHT_ONLY_SCHEME: None}


def intx_weight(w: LinearWeights, activation: str | None):
    """``w`` as torchao's ``IntxUnpackedToInt8Tensor``, the tensor type that the 8da schemes'
    XNNPACK lowering consumes (torchao 0.18): the codes as they are, zero points 0, block
    ``(1, group)``; with ``activation`` the linear quantizes its input to int8 per token."""
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8Tensor,
    )

    target = {4: torch.int4, 8: torch.int8}[w.bits]
    # copies: the model must not alias the decided weights that the read-back compares with
    return IntxUnpackedToInt8Tensor(
        w.qdata.clone(), w.scale.clone(), torch.zeros_like(w.scale, dtype=torch.int8), target,
        (1, w.group), torch.float32, activation)


@torch.no_grad()
def quantize_for_xnnpack(model: nn.Module, weights: PhoneWeights, scheme: str) -> nn.Module:
    """Put ``weights`` into ``model``'s linears in place (with ``scheme``'s activation
    quantization), and the embedding int8 per row."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    modules = dict(model.named_modules())
    missing = [n for n, m in modules.items() if isinstance(m, nn.Linear) and n not in weights.linears]
    if missing:
        raise CpuQuantError(f"no integer weights for {missing[0]} ({len(missing)} linears)")
    for name, w in weights.linears.items():
        modules[name].weight = nn.Parameter(intx_weight(w, ACTIVATION[scheme]),
                                            requires_grad=False)
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    return model


def lower_to_xnnpack(programs: dict) -> object:
    """ExportedPrograms by method name -> ExecutorchProgramManager with XNNPACK delegates.

    One method at a time: ExecuTorch's lowering copies a method's program, weights included,
    more than once on its way to the edge dialect and the delegate, and given every method at
    once it holds all their copies together (a two-method 1B program ran a 24 GiB machine out
    of memory). Each method is lowered alone and its intermediates dropped before the next;
    the lowered methods are then put together, their delegates' weights merged into one named
    data store, as the joint lowering does (the program's bytes are the same)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeProgramManager, ExecutorchBackendConfig, to_edge_transform_and_lower

    lowered = {}
    for name, program in programs.items():
        one = to_edge_transform_and_lower({name: program}, partitioner=[XnnpackPartitioner()])
        lowered[name] = one.exported_program(name)
        del one
        gc.collect()
    edge = EdgeProgramManager(lowered)
    # Quant fusion turns the embedding's dequantize+gather into embedding_byte.
    return edge.to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))


@dataclass(frozen=True)
class ProbeResult:
    snr_db: float
    correct: bool


class _ProbeLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.proj = nn.Linear(64, 32, bias=False)
        # Rows of very different magnitude, so a lost or swapped per-channel scale is visible.
        row_scale = torch.logspace(-2, 1, 32).unsqueeze(1)
        self.proj.weight.data = torch.randn(32, 64, generator=gen) * row_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@functools.lru_cache(maxsize=1)
def probe_weight_only_int8() -> ProbeResult:
    """Export one int8 weight-only linear to XNNPACK, run it, compare with its eager graph."""
    model = _ProbeLinear().eval()
    weights = PhoneWeights({"proj": int8_per_channel(model.proj.weight.data, None)})
    quantize_for_xnnpack(model, weights, WEIGHT_ONLY_SCHEME)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        program = torch.export.export(model, (x,), strict=False)
    manager = lower_to_xnnpack({"forward": program})
    method = executorch_runtime().load_program(manager.buffer).load_method("forward")
    got = method.execute([x])[0]
    snr = snr_db(got, expected)
    return ProbeResult(snr, snr >= PROBE_MIN_SNR_DB)


def check_scheme(scheme: str) -> None:
    """Refuse schemes XNNPACK does not execute correctly (see the module docstring)."""
    if scheme in XNNPACK_SCHEMES:
        return
    if scheme == WEIGHT_ONLY_SCHEME:
        probe = probe_weight_only_int8()
        if probe.correct:
            return
        raise CpuQuantError(
            "--scheme 8w (int8 weight-only) is refused on XNNPACK: executorch's XNNPACK path for "
            "it drops a per-channel scale and returns wrong logits (a one-layer probe just "
            f"measured {probe.snr_db:.1f} dB against its own eager graph); use 8da8w or 8da4w")
    raise CpuQuantError(f"unknown XNNPACK scheme {scheme!r} "
                        f"(choose from {', '.join(XNNPACK_SCHEMES)})")
