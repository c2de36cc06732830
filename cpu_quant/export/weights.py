"""The integer weights of a phone program: every linear's codes and scales, chosen before export.

A phone program stores each linear as signed integer codes ``a`` and positive block scales
``s``, ``w = a · s`` (no zero points). This module decides those values; the backends
(``xnnpack``, ``qnn``) only put them into the tensor types their lowering consumes, so the
program holds exactly what was decided here, and ``readback`` checks that it does.

Where the codes come from (``PhoneWeights.origin`` per linear):

* ``gptq``: 4-bit weights are the calibrated GPTQ result, read through the formats registry
  from an artifact of ``cpu-quant gptq`` (``--quantized DIR``, or a run the export makes
  itself with the same settings: ``gptq_settings``). The artifact must use the grid the phone
  stores: symmetric (zero pinned at 8, so ``a = q - 8``) with scales ``>= 0``
  (``--positive-scales``). A negative scale is refused, not converted: flipping a group's sign
  maps its codes ``a -> -a``, and the ``-8`` that a negative-scale group uses for its largest
  weight has no ``+8`` in int4. A group whose weights are all zero has scale 0 and codes 0; it
  is stored with scale 1 (same weights, and the runtimes take positive scales only).
* ``weighted search``: 8-bit weights, one scale per output channel, from the weighted scale
  search (``quantize.scale_search``, :data:`INT8` levels) with the input-channel importance
  ``E[x²]`` measured on calibration text (``activation_stats``).

The rule for a linear the 4-bit scheme cannot take: the group comes from the GPTQ plan (the
requested group when it divides the in-features, else the largest smaller group of 128, 64 and
32 that does; ``quantize.plan``); a linear that no such group divides (in-features not a
multiple of 32), or that the artifact keeps in float, gets 8-bit weights per output channel
instead, and the export reports it (``PhoneWeights.notes``). Nothing is left in float silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..core.errors import CpuQuantError
from ..core.grid import QZERO, GroupQuant
from ..quantize.scale_search import INT4, INT8, SignedLevels, quantize_signed, search_symmetric_scales

HEAD = "lm_head"


@dataclass
class LinearWeights:
    """One linear as the phone program stores it: ``w[n, k] = qdata[n, k] · scale[n, k // group]``."""

    qdata: torch.Tensor  # int8 [N, K], within ``levels``
    scale: torch.Tensor  # float32 [N, K // group], > 0
    levels: SignedLevels
    group: int  # K: one scale per output channel
    origin: str  # "gptq" or "weighted search"

    @property
    def bits(self) -> int:
        return self.levels.bits

    @property
    def per_channel(self) -> bool:
        return self.group == self.qdata.shape[1]

    def dequantize(self) -> torch.Tensor:
        n, k = self.qdata.shape
        a = self.qdata.to(torch.float32).view(n, k // self.group, self.group)
        return (a * self.scale.unsqueeze(-1)).reshape(n, k)


@dataclass
class PhoneWeights:
    """The integer weights of every linear of the static graph, by its module name."""

    linears: dict[str, LinearWeights]
    notes: list[str] = field(default_factory=list)  # the stated rule, where it applied
    source: dict = field(default_factory=dict)  # where the codes came from (report)

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for w in self.linears.values():
            key = f"int{w.bits} " + ("per channel" if w.per_channel else f"group {w.group}") \
                + f" ({w.origin})"
            kinds[key] = kinds.get(key, 0) + 1
        return {"linears": kinds, "notes": self.notes, "source": self.source}


def static_name(hf_module: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``layers.3.mlp.up_proj`` (the static graph's name)."""
    return hf_module.removeprefix("model.")


def from_group_quant(gq: GroupQuant, module: str) -> LinearWeights:
    """A symmetric 4-bit result as stored codes: ``a = q - 8``, the scales as they are."""
    if gq.zeros is not None:
        raise CpuQuantError(f"{module}: the artifact has zero points (an asymmetric grid); the "
                            "phone's int4 weights are symmetric: quantize with the GPTQ format")
    negative = int((gq.scales < 0).sum())
    if negative:
        raise CpuQuantError(f"{module}: {negative} groups have negative scales, which XNNPACK "
                            "and QNN cannot store; quantize with `cpu-quant gptq "
                            "--positive-scales`")
    scale = gq.scales.to(torch.float32)
    qdata = (gq.codes.to(torch.int16) - QZERO).to(torch.int8)
    n, k = qdata.shape
    empty = scale == 0
    if bool(empty.any()):
        zero_codes = qdata.view(n, k // gq.group_size, gq.group_size).eq(0).all(-1)
        if not bool(zero_codes[empty].all()):
            raise CpuQuantError(f"{module}: a group with scale 0 has non-zero codes")
        scale = torch.where(empty, torch.ones_like(scale), scale)
    return LinearWeights(qdata.contiguous(), scale.contiguous(), INT4, gq.group_size, "gptq")


def int8_per_channel(weight: torch.Tensor, importance: torch.Tensor | None) -> LinearWeights:
    """8-bit codes, one scale per output channel, by the weighted scale search.

    importance: [K] input-channel ``E[x²]`` (None: uniform)."""
    w = weight.to(torch.float32)
    imp = None if importance is None else importance.reshape(1, -1).to(torch.float32)
    scale = search_symmetric_scales(w, imp, positive=True, levels=INT8)  # [N, 1]
    qdata = quantize_signed(w, scale, INT8)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # all-zero row: codes 0
    return LinearWeights(qdata, scale.contiguous(), INT8, w.shape[1], "weighted search")


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@dataclass
class ChannelStats:
    """Per input channel of one linear, over the calibration text."""

    mean_sq: torch.Tensor  # [K] E[x²]: the channel's weight in the scale search
    abs_max: torch.Tensor  # [K] max |x|: what the activation smoothing balances


@torch.no_grad()
def activation_stats(model: nn.Module, score: callable) -> dict[str, ChannelStats]:
    """``E[x²]`` and ``max|x|`` per input channel of every linear, over what ``score()`` feeds
    the model (the float graph on calibration text)."""
    sums: dict[str, torch.Tensor] = {}
    maxes: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}

    def hook(name: str):
        def record(module, inputs):
            x = inputs[0].detach().to(torch.float32).reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            amax = x.abs().amax(0)
            maxes[name] = torch.maximum(maxes[name], amax) if name in maxes else amax
            rows[name] = rows.get(name, 0) + x.shape[0]
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linear_modules(model).items()]
    try:
        score()
    finally:
        for h in handles:
            h.remove()
    return {name: ChannelStats(sums[name] / rows[name], maxes[name]) for name in sums}


def importance(stats: dict[str, ChannelStats]) -> dict[str, torch.Tensor]:
    return {name: st.mean_sq for name, st in stats.items()}


def weights_8bit(model: nn.Module, importance: dict[str, torch.Tensor]) -> PhoneWeights:
    """Every linear at 8 bits per output channel (XNNPACK's 8da8w and 8-bit weight-only; QNN's
    w8a16 leaves its weights to QNN's own quantizer)."""
    linears = {name: int8_per_channel(m.weight.data, importance.get(name))
               for name, m in linear_modules(model).items()}
    return PhoneWeights(linears, source={"origin": "weighted scale search, 8-bit per channel"})


def weights_from_gptq(model: nn.Module, results: dict[str, GroupQuant],
                      importance: dict[str, torch.Tensor], source: dict,
                      reasons: dict[str, str] | None = None) -> PhoneWeights:
    """4-bit codes from a GPTQ result by static-graph name; the stated rule for the rest
    (``reasons``: why a linear is not in the result, where the export chose that)."""
    linears: dict[str, LinearWeights] = {}
    notes: list[str] = []
    for name, m in linear_modules(model).items():
        gq = results.get(name)
        if gq is None:
            linears[name] = int8_per_channel(m.weight.data, importance.get(name))
            why = (reasons or {}).get(name, f"in-features {m.in_features}")
            notes.append(f"{name}: not quantized to 4 bits by the GPTQ run ({why}); stored at "
                         "8 bits per output channel")
            continue
        if tuple(gq.codes.shape) != (m.out_features, m.in_features):
            raise CpuQuantError(f"{name}: the quantized artifact has shape "
                                f"{list(gq.codes.shape)}, the model {[m.out_features, m.in_features]}")
        linears[name] = from_group_quant(gq, name)
    return PhoneWeights(linears, notes, source)


def read_group_quants(path: str | Path) -> tuple[dict[str, GroupQuant], dict]:
    """Every quantized linear of a ``cpu-quant gptq`` artifact, by static-graph name, through
    the formats registry; and its ``quantization_config``."""
    from ..core.io.checkpoint import open_checkpoint
    from ..formats import format_for_quant_method

    ckpt = open_checkpoint(path)
    try:
        qcfg = ckpt.config.get("quantization_config")
        if not isinstance(qcfg, dict):
            raise CpuQuantError(f"{path} is not a quantized checkpoint (no quantization_config)")
        fmt = format_for_quant_method(qcfg.get("quant_method"))
        if fmt is None:
            raise CpuQuantError(f"{path}: quant_method {qcfg.get('quant_method')!r} is not a "
                                "format cpu-quant reads")
        if int(qcfg.get("bits", 4)) != 4:
            raise CpuQuantError(f"{path}: {qcfg.get('bits')}-bit weights; the phone's quantized "
                                "artifact must be 4-bit")
        results = {static_name(m): fmt.unpack(fmt.read_tensors(ckpt, m), qcfg, m)
                   for m in fmt.modules(ckpt)}
        return results, qcfg
    finally:
        ckpt.close()


def check_same_source(quantized: str | Path, src: str | Path) -> None:
    """The artifact's float tensors (embedding, norms) must be the source's, bit for bit (of a
    ``gptq --smooth`` artifact: the source's folded with its factors): codes from another model
    would otherwise pass every shape check."""
    from ..core.io.checkpoint import open_checkpoint
    from ..core.smoothing_factors import load_factors, smoothed_source

    art, ref = open_checkpoint(quantized), open_checkpoint(src)
    try:
        factors = load_factors(quantized)
        if factors is not None:  # a gptq --smooth artifact: its norms are the source's folded
            ref = smoothed_source(ref, factors, str(quantized))
        pattern = re.compile(r"(embed_tokens|norm)\.weight$")
        names = [n for n in art.names if pattern.search(n)]
        if not names:
            raise CpuQuantError(f"{quantized} holds no embedding or norm tensors to check "
                                "against the source")
        for name in names:
            if name not in ref.files or not torch.equal(
                    art.tensor(name).to(torch.bfloat16), ref.tensor(name).to(torch.bfloat16)):
                raise CpuQuantError(f"{quantized} was not quantized from {src} ({name} "
                                    "differs)")
    finally:
        art.close()
        ref.close()


@torch.no_grad()
def fold_smoothing(model: nn.Module, src: str | Path, factors: dict[str, torch.Tensor]) -> int:
    """Put into the static graph ``model`` the tensors a ``gptq --smooth`` run quantized: every
    tensor its folds change, read from the source through the same folds (the norms in bf16,
    as the artifact stores them). The float reference is a copy taken before. Returns how many
    tensors changed."""
    from ..core.io.checkpoint import open_checkpoint
    from ..core.smoothing_factors import HEAD, smoothed_source

    view = smoothed_source(open_checkpoint(src), factors, "the quantized artifact")
    changed = 0
    try:
        for name, p in model.named_parameters():
            hf = name if name.startswith("lm_head.") else "model." + name
            if hf not in view.changed:
                continue
            if hf == HEAD:
                tied = "lm_head.weight" not in view.names
                t = view.head_tensor("model.embed_tokens.weight" if tied else HEAD, HEAD)
            else:
                t = view.tensor(hf)
            if tuple(t.shape) != tuple(p.shape):
                raise CpuQuantError(f"{hf}: the source's folded tensor has shape "
                                    f"{list(t.shape)}, the model {list(p.shape)}")
            p.data = t.to(p.dtype)
            changed += 1
    finally:
        view.close()
    return changed
