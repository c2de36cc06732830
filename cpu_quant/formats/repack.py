"""One module from one safetensors layout into another, bit for bit: what ``convert`` and the
tinygemm loader (``cpu_quant.load_quantized``) both do to every quantized module."""

from __future__ import annotations

import torch

from ..core.errors import CpuQuantError
from ..core.grid import GroupQuant
from .safetensors import SafetensorsFormat


def _same_fields(a: GroupQuant, b: GroupQuant) -> bool:
    """Same codes, scales, zeros and group: then the dequantizations are equal too (the cheap
    test; the full comparison decides only when it fails)."""
    def zeros(gq: GroupQuant) -> torch.Tensor:
        return torch.zeros_like(gq.scales) if gq.zeros is None else gq.zeros

    return (a.group_size == b.group_size and torch.equal(a.codes, b.codes)
            and torch.equal(a.scales, b.scales) and torch.equal(zeros(a), zeros(b)))


def repack_module(source: SafetensorsFormat, target: SafetensorsFormat,
                  tensors: dict[str, torch.Tensor], qcfg: dict, module: str
                  ) -> tuple[GroupQuant, dict[str, torch.Tensor]]:
    """One module's ``source`` tensors as ``target`` tensors holding the same weights bit for bit
    (unpacked, packed, unpacked again and dequantized: both readings must be equal), or a
    :class:`CpuQuantError` naming the module and why not. ``convert`` and
    ``cpu_quant.load_quantized`` both repack through here."""
    gq = source.unpack(tensors, qcfg, module)
    if not bool(torch.isfinite(gq.scales).all()):
        raise CpuQuantError(f"{module}: a stored scale is NaN or Inf")
    if gq.zeros is not None and not target.limits.stores_zeros:
        raise CpuQuantError(f"{module}: the stored zero points are not all 8 (an asymmetric "
                            f"grid); {target.name} holds only the symmetric grid")
    packed = target.pack(gq, module)
    back = target.unpack(packed, {"format_version": 1}, module)
    if not _same_fields(back, gq) and not torch.equal(back.dequantize(), gq.dequantize()):
        raise CpuQuantError(f"{module}: {target.name} cannot hold these weights exactly (its "
                            "stored scales or zeros round them)")
    return gq, packed
