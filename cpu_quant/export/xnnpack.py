"""Phone-CPU programs: torchao dynamic-int8-activation schemes lowered to ExecuTorch's XNNPACK.

Schemes (every ``nn.Linear``, the output head included; the embedding is a gather, which
XNNPACK does not run, so it is stored int8 per row and executed by the quantized kernels as
``quantized_decomposed::embedding_byte``):

* ``8da8w``: int8 symmetric weights, one fp32 scale per output channel; activations quantized
  to int8 per token (asymmetric) at run time. XNNPACK ``qd8-f32-qc8w``.
* ``8da4w``: int4 symmetric weights in groups of ``group_size`` input channels, activations as
  above. XNNPACK ``qd8-f32-qb4w``. XNNPACK stores block scales as **bf16**
  (``backends/xnnpack/operators/node_visitor.py``, executorch 1.5.1), so the scales are rounded
  to bf16 before export (``quantize.grid.round_scale``): the eager model then is the exact model
  the program computes. Before that rounding the program and its eager graph agreed to 35.6 dB;
  after it, 51.7 dB (4-layer SmolLM2, 64 held-out tokens).
* ``8w`` (int8 weight-only): refused. In executorch 1.5.1 the XNNPACK path for it exports and
  runs but returns wrong logits: a per-channel scale is lost (measured -35.9 dB against its own
  eager graph). ``probe_weight_only_int8`` really exports one small weight-only linear, runs it
  through the runtime and compares; the scheme is offered again only when that probe passes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import CpuQuantError
from ..quantize.grid import round_scale
from .verify import snr_db

XNNPACK_SCHEMES = ("8da8w", "8da4w")
WEIGHT_ONLY_SCHEME = "8w"
# A program that implements its eager graph differs from it by accumulation order only;
# the weight-only bug shows up below 0 dB. Half-way, on a log scale, separates them.
PROBE_MIN_SNR_DB = 30.0


def _linear_config(scheme: str, group_size: int):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if scheme == "8da8w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8,
                                                     weight_granularity=PerAxis(0))
    if scheme == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                     weight_granularity=PerGroup(group_size))
    if scheme == WEIGHT_ONLY_SCHEME:
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    raise CpuQuantError(f"unknown XNNPACK scheme {scheme!r} (choose from {', '.join(XNNPACK_SCHEMES)})")


def check_group_size(model: nn.Module, scheme: str, group_size: int) -> None:
    if scheme != "8da4w":
        return
    if group_size < 2 or group_size % 2:
        raise CpuQuantError(f"--group-size must be an even number >= 2, got {group_size}")
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.in_features % group_size:
            raise CpuQuantError(f"--group-size {group_size} does not divide the {mod.in_features} "
                                f"input features of {name}")


@torch.no_grad()
def quantize_for_xnnpack(model: nn.Module, scheme: str, group_size: int) -> nn.Module:
    """Quantize ``model`` in place (linears per ``scheme``, embedding int8 per row)."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    check_group_size(model, scheme, group_size)
    quantize_(model, _linear_config(scheme, group_size),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    if scheme == "8da4w":
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.scale.copy_(round_scale(mod.weight.scale))
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    return model


def lower_to_xnnpack(programs: dict) -> object:
    """ExportedPrograms by method name -> ExecutorchProgramManager with XNNPACK delegates."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])
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
    from executorch.runtime import Runtime

    model = _ProbeLinear().eval()
    quantize_for_probe = _linear_config(WEIGHT_ONLY_SCHEME, 0)
    from torchao.quantization import quantize_

    quantize_(model, quantize_for_probe)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        program = torch.export.export(model, (x,), strict=False)
    manager = lower_to_xnnpack({"forward": program})
    method = Runtime.get().load_program(manager.buffer).load_method("forward")
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
