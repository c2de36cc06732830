"""What a quantization run hands each requested format: a :class:`Sink` takes the run's
quantized linears and float tensors as they come, and :class:`ArtifactInfo` what it needs at the
end to write its config and metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.block_grid import BlockQuant
from ..core.grid import GroupQuant


@dataclass
class ArtifactInfo:
    """What a sink needs at the end of a run to write its config and metadata."""

    source: Path
    source_config: dict
    default_group: int
    head_quantized: bool
    dynamic: dict[str, dict]
    symmetric: bool
    extra: dict = field(default_factory=dict)  # provenance for the quantization config
    report: dict = field(default_factory=dict)  # quantization_report.json


class Sink:
    """Where one format's share of a run goes. ``end_layer`` persists what it has so far (the
    run's resume point names it in ``state()``); ``finish`` writes the rest."""

    def add_module(self, module: str, gq: GroupQuant | BlockQuant) -> int:
        """Take one quantized linear (a :class:`BlockQuant` only for a format with grids of
        its own: ``Format.own_grids``); return the bytes it stores."""
        raise NotImplementedError

    def add_tensor(self, name: str, tensor: torch.Tensor) -> int:
        """Take one float tensor (bf16), by its Hugging Face name; return its bytes."""
        raise NotImplementedError

    def end_layer(self, index: int) -> None:
        raise NotImplementedError

    def state(self) -> dict:
        return {}

    def finish(self, info: ArtifactInfo) -> None:
        raise NotImplementedError
