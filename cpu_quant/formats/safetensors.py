"""What every safetensors format shares: :class:`SafetensorsFormat` (per quantized linear a fixed
set of tensors, ``pack``/``unpack`` and the ``quantization_config``), and its sink: one shard per
decoder layer, then the outer tensors.

Shard ``i + 1`` of ``n_layers + 1`` holds decoder layer ``i`` (its quantized linears in the
format's tensors, its norms in bf16); the last holds the embedding, the final norm and the
head. ``finish`` writes ``model.safetensors.index.json``, ``config.json`` (the source's, with
the format's ``quantization_config`` and the head untied when it is quantized), the tokenizer
files and ``quantization_report.json``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from ..core.grid import GroupQuant
from ..core.io.artifact import copy_tokenizer_files, write_json_atomic, write_shard_index_at
from ..core.io.safetensors_writer import write_safetensors
from .base import Format, TensorSpec
from .sink import ArtifactInfo, Sink

if TYPE_CHECKING:
    from ..core.io.checkpoint import Checkpoint



class SafetensorsFormat(Format):
    """A format of per-module safetensors tensors plus ``quantization_config`` in config.json."""

    repackable = True

    tensors: ClassVar[tuple[TensorSpec, ...]]
    marker: ClassVar[str]  # the tensor whose shape gives N and K
    scales_suffix: ClassVar[str]
    scales_group_axis: ClassVar[int]  # the axis of the scales tensor that counts the groups
    head_kernel: ClassVar[str]  # the kernel a bf16 head slows down, named by verify
    # what verify accepts (its readers may take more than the writer writes); None: ``limits``
    verify_groups: ClassVar[tuple[int, ...] | None] = None
    verify_k_multiple: ClassVar[int | None] = None
    verify_n_multiple: ClassVar[int | None] = None
    bits: ClassVar[tuple[int, ...]] = (4,)

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(t.suffix for t in self.tensors)

    def tensor_spec(self, suffix: str) -> TensorSpec:
        return next(t for t in self.tensors if t.suffix == suffix)

    def dims_from_marker(self, shape: tuple[int, ...], bits: int) -> tuple[int, int]:
        """(N, K) of a module from its marker tensor's shape."""
        raise NotImplementedError

    def pack(self, gq: GroupQuant, module: str = "module") -> dict[str, torch.Tensor]:
        """One quantization result as this format's tensors (suffix -> tensor)."""
        raise NotImplementedError

    def unpack(self, tensors: dict[str, torch.Tensor], qcfg: dict, module: str = "module"
               ) -> GroupQuant:
        """This format's tensors of one module back to the quantization result, exactly."""
        raise NotImplementedError

    def dequantize(self, tensors: dict[str, torch.Tensor], qcfg: dict) -> torch.Tensor:
        """A faithful float32 [N, K] reading of one module, for eval (foreign files included)."""
        return self.unpack(tensors, qcfg).dequantize()

    def quantization_config(self, info: ArtifactInfo) -> dict:
        raise NotImplementedError

    def read_tensors(self, ckpt: Checkpoint, module: str) -> dict[str, torch.Tensor]:
        return {s: ckpt.tensor(f"{module}.{s}") for s in self.suffixes if f"{module}.{s}" in ckpt.files}

    def modules(self, ckpt: Checkpoint) -> list[str]:
        suffix = "." + self.marker
        return sorted(n[: -len(suffix)] for n in ckpt.names if n.endswith(suffix))

    def checkpoint_format(self, qcfg: dict) -> str | None:
        """The sub-format a config declares (GPTQ's zero convention), if the format has one."""
        return None

    def config_findings(self, qcfg: dict) -> Iterator:
        """Format-specific problems of ``quantization_config`` (verify's Finding objects)."""
        return iter(())

    def module_findings(self, ctx, mod) -> Iterator:
        """Format-specific checks of one module's stored values (verify's Finding objects)."""
        return iter(())

    def open_sink(self, directory: Path, n_layers: int, resume_state: dict | None) -> Sink:
        return SafetensorsSink(self, directory, n_layers, resume_state)


def untie_head(config: dict) -> None:
    """Mark ``config`` (and its ``text_config``) as having a head of its own."""
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["tie_word_embeddings"] = False


def artifact_config(source_config: dict, quantization_config: dict, head_quantized: bool) -> dict:
    """The source's config.json for a quantized artifact: bf16, the head untied if quantized."""
    config = dict(source_config)
    config["dtype"] = "bfloat16"
    config.pop("torch_dtype", None)
    if head_quantized:
        untie_head(config)
    config["quantization_config"] = quantization_config
    return config


class SafetensorsSink(Sink):
    def __init__(self, fmt: SafetensorsFormat, directory: Path, n_layers: int,
                 resume_state: dict | None) -> None:
        self.fmt = fmt
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.n_shards = n_layers + 1
        state = resume_state or {}
        self.shards: dict[str, list[str]] = {k: list(v) for k, v in state.get("shards", {}).items()}
        self.total_bytes = int(state.get("total_bytes", 0))
        self._pending: dict[str, torch.Tensor] = {}

    def add_module(self, module: str, gq: GroupQuant) -> int:
        tensors = self.fmt.pack(gq, module)
        self._pending.update({f"{module}.{k}": v for k, v in tensors.items()})
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def add_tensor(self, name: str, tensor: torch.Tensor) -> int:
        self._pending[name] = tensor
        return tensor.numel() * tensor.element_size()

    def end_layer(self, index: int) -> None:
        fname = f"model-{index + 1:05d}-of-{self.n_shards:05d}.safetensors"
        self.total_bytes += write_safetensors(self.directory / fname, self._pending)
        self.shards[fname] = sorted(self._pending)
        self._pending = {}

    def state(self) -> dict:
        return {"shards": self.shards, "total_bytes": self.total_bytes}

    def finish(self, info: ArtifactInfo) -> None:
        write_shard_index_at(self.directory, self.shards, self.total_bytes)
        config = artifact_config(info.source_config, self.fmt.quantization_config(info),
                                 info.head_quantized)
        write_json_atomic(self.directory / "config.json", config)
        copy_tokenizer_files(info.source, self.directory)
        write_json_atomic(self.directory / "quantization_report.json",
                          {**info.report, "layout": self.fmt.name})
