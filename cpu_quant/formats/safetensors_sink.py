"""The sink of every safetensors format: one shard per decoder layer, then the outer tensors.

Shard ``i + 1`` of ``n_layers + 1`` holds decoder layer ``i`` (its quantized linears in the
format's tensors, its norms in bf16); the last holds the embedding, the final norm and the
head. ``finish`` writes ``model.safetensors.index.json``, ``config.json`` (the source's, with
the format's ``quantization_config`` and the head untied when it is quantized), the tokenizer
files and ``quantization_report.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..io.artifact import copy_tokenizer_files, write_json_atomic, write_shard_index_at
from ..io.safetensors_writer import write_safetensors
from ..quantize.grid import GroupQuant
from .base import ArtifactInfo, SafetensorsFormat, Sink


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
