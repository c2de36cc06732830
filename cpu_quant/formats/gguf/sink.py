"""The GGUF sink: each layer's results as a part file during the run, then one GGUF file."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from ...core.block_grid import BlockQuant
from ...core.errors import CpuQuantError
from ...core.grid import GroupQuant
from ...core.io.safetensors_writer import write_safetensors
from ..base import Format
from ..sink import ArtifactInfo, Sink
from .architectures import ArchSpec, _write_hyperparameters, arch_spec, permute_rope_rows
from .block_types import QUANT_TYPES
from .experts import is_router, stacked_name
from .q4_0 import F32, Q4_0, pack_q4_0
from .tokenizer import _write_tokenizer
from .vision import (
    LANGUAGE_PREFIX_KEY,
    is_kept,
    language_config,
    language_name,
    mmproj_file_name,
    vision_gguf,
    write_mmproj,
)

PARTS_DIR = ".gguf-parts"
# The type of token_embd (and of the head when it is not quantized). Measured in llama.cpp on the
# demo model (tied head, held-out text, gguf-fidelity-20261202T151917Z/151943Z.json): F16 instead
# of Q8_0 takes KL from 0.0744 to 0.0723 nats for +26% file size (8.5 against 16 bits per weight
# on the model's largest tensor); llama.cpp's own Q4_0 of the model picks Q8_0 as well.
EMBEDDING_TYPE = gguf.GGMLQuantizationType.Q8_0
FLOAT_LINEAR_TYPE = gguf.GGMLQuantizationType.BF16
BF16 = gguf.GGMLQuantizationType.BF16




def _part_name(index: int) -> str:
    return f"part-{index:05d}.safetensors"


@dataclass(frozen=True)
class _Entry:
    """One tensor of the final file: where its part data is and how it is converted."""

    gguf_name: str
    hf_name: str
    part: Path
    kind: str  # q4_0 | a block type's name (Q4_K, ...) | norm | bias | embedding | float_linear | router
    # a stacked tensor (experts.py): its part tensors, in expert order; hf_name is then the
    # stacked tensor's name as the converter names it before mapping
    members: tuple[str, ...] = ()

    def shape(self, f) -> tuple[int, ...]:
        if self.members:
            return (len(self.members), *f.get_slice(self.members[0]).get_shape())
        return tuple(f.get_slice(self.hf_name).get_shape())

    def tensor(self, f) -> torch.Tensor:
        if self.members:
            return torch.stack([f.get_tensor(m) for m in self.members])
        return f.get_tensor(self.hf_name)


# the kinds whose part data is the quantized blocks, and their types
QUANTIZED_KINDS = {"q4_0": Q4_0, **{t.name: t.qtype for t in QUANT_TYPES.values()}}


class GGUFSink(Sink):
    def __init__(self, fmt: Format, directory: Path, n_layers: int, resume_state: dict | None):
        self.fmt = fmt
        self.directory = Path(directory)
        self.parts_dir = self.directory / PARTS_DIR
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        self.n_layers = n_layers
        state = resume_state or {}
        self.parts: list[str] = list(state.get("parts", []))
        self.kinds: dict[str, str] = dict(state.get("kinds", {}))
        self._pending: dict[str, torch.Tensor] = {}

    def add_module(self, module: str, gq: GroupQuant | BlockQuant) -> int:
        if isinstance(gq, BlockQuant):
            qt = next((t for t in QUANT_TYPES.values() if t.grid == gq.grid), None)
            if qt is None:
                raise CpuQuantError(f"{module}: no GGUF type has this block grid")
            blocks, kind = qt.pack(gq), qt.name
        else:
            blocks, kind = pack_q4_0(gq, module), "q4_0"
        self._pending[module] = blocks
        self.kinds[module] = kind
        return blocks.numel()

    def add_tensor(self, name: str, tensor: torch.Tensor) -> int:
        t = tensor.detach().contiguous()
        self._pending[name] = t
        self.kinds[name] = _float_kind(name)
        return t.numel() * t.element_size()

    def end_layer(self, index: int) -> None:
        name = _part_name(index)
        write_safetensors(self.parts_dir / name, self._pending)
        self._pending = {}
        if name not in self.parts:
            self.parts.append(name)

    def state(self) -> dict:
        return {"parts": list(self.parts), "kinds": dict(self.kinds)}

    def finish(self, info: ArtifactInfo) -> None:
        if self._pending:
            self.end_layer(self.n_layers)
        cfg = info.source_config  # a vision-language model's: the language model's is lm_cfg
        lm_cfg = language_config(cfg)
        spec = arch_spec(lm_cfg)
        target = self.directory / gguf_file_name(info.source, self.fmt.file_suffix)
        entries, kept = self._entries(spec, cfg)
        written = []
        try:
            if kept:  # the vision tower and the projector: llama.cpp's projector file
                mmproj = self.directory / mmproj_file_name(model_name(info.source), BF16)
                written.append(mmproj.with_name(mmproj.name + ".partial"))
                write_mmproj(written[-1], cfg, Path(info.source), model_name(info.source), kept)
            tmp = target.with_name(target.name + ".partial")
            written.append(tmp)
            tmp.unlink(missing_ok=True)
            prefix = vision_gguf(cfg).text_prefix if kept else None  # type: ignore[union-attr]
            _write_file(tmp, spec, lm_cfg, info, entries, self.fmt, prefix)
            for path in written:
                os.replace(path, path.with_name(path.name[: -len(".partial")]))
        except BaseException:
            for path in written:
                path.unlink(missing_ok=True)
            raise
        report = target.with_name(target.name[: -len(".gguf")] + ".quantization_report.json")
        rtmp = report.with_name(report.name + ".tmp")
        rtmp.write_text(json.dumps(info.report, indent=2, sort_keys=True))
        os.replace(rtmp, report)
        shutil.rmtree(self.parts_dir, ignore_errors=True)

    def _entries(self, spec: ArchSpec, cfg: dict) -> tuple[list[_Entry], list[tuple[str, Path]]]:
        """The language model's tensors (entries of the model file) and, for a vision-language
        model, the kept tensors of its vision tower and projector (name, part) for the
        projector file."""
        lm_cfg = language_config(cfg)
        names = gguf.get_tensor_name_map(spec.arch, int(lm_cfg["num_hidden_layers"]))
        tied = bool(lm_cfg.get("tie_word_embeddings", False))
        # the format's tied file: the quantized head is token_embd, the embedding not written
        head_is_embd = self.fmt.ties_head(cfg) and self.kinds.get("lm_head") in QUANTIZED_KINDS
        entries, kept = [], []
        stacks: dict[str, dict[int, tuple[str, str, Path]]] = {}  # experts.py
        for part in self.parts:
            path = self.parts_dir / part
            with safe_open(path, "pt") as f:
                keys = sorted(f.keys())
            for hf in keys:
                if is_kept(cfg, hf):
                    kept.append((hf, path))
                    continue
                lm = language_name(cfg, hf)  # the decoder's name (model.text_model.X -> model.X)
                kind = self.kinds.get(hf)
                if kind is None or kind not in QUANTIZED_KINDS:
                    kind = _float_kind(lm)
                if (stacked := stacked_name(hf)) is not None:
                    stacks.setdefault(stacked[0], {})[stacked[1]] = (hf, kind, path)
                    continue
                quantized = kind in QUANTIZED_KINDS
                if lm == "lm_head.weight" and not quantized and (tied or not spec.head_tensor):
                    continue  # llama.cpp reads token_embd as the head
                if head_is_embd and kind == "embedding":
                    continue  # the head's tensor stands for it
                if lm == "lm_head" and not spec.head_tensor and not head_is_embd:
                    raise CpuQuantError(f"gguf: {spec.name} has no output tensor; do not quantize its head")
                lookup = lm + ".weight" if quantized else lm
                gname = names.get_name(lookup, try_suffixes=(".weight", ".bias"))
                if lm == "lm_head" and head_is_embd:
                    gname = "token_embd.weight"
                if gname is None:
                    raise CpuQuantError(f"gguf: {hf} has no {spec.name} tensor name in llama.cpp")
                entries.append(_Entry(gname, hf, path, kind))
        entries += [_stacked_entry(names, spec, name, experts) for name, experts in stacks.items()]
        return sorted(entries, key=lambda e: _tensor_order(e.gguf_name)), kept


def _stacked_entry(names: gguf.TensorNameMap, spec: ArchSpec, name: str,
                   experts: dict[int, tuple[str, str, Path]]) -> _Entry:
    """One stacked expert tensor from every expert's part tensor (experts.py)."""
    kinds = {kind for _, kind, _ in experts.values()}
    paths = {path for _, _, path in experts.values()}
    if sorted(experts) != list(range(len(experts))) or len(kinds) != 1 or len(paths) != 1:
        raise CpuQuantError(f"gguf: {name}: the experts' tensors are not one kind, in one layer, "
                            f"numbered 0..{len(experts) - 1}")
    gname = names.get_name(name, try_suffixes=(".weight",))
    if gname is None:
        raise CpuQuantError(f"gguf: {name} has no {spec.name} tensor name in llama.cpp")
    return _Entry(gname, name, paths.pop(), kinds.pop(),
                  tuple(experts[e][0] for e in range(len(experts))))


def _float_kind(name: str) -> str:
    if is_router(name):
        return "router"
    if "norm" in name.rsplit(".", 2)[-2]:
        return "norm"
    if name.endswith(".bias"):
        return "bias"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embedding"
    return "float_linear"


def _tensor_order(gname: str) -> tuple:
    m = re.match(r"blk\.(\d+)\.", gname)
    if m:
        return (1, int(m.group(1)), gname)
    return (0 if gname.startswith("token_embd") else 2, 0, gname)


def model_name(source: Path) -> str:
    """The source directory's name without a trailing ``-bf16``."""
    stem = Path(source).name
    return stem[:-5] if stem.endswith("-bf16") else stem


def gguf_file_name(source: Path, suffix: str = "-Q4_0.gguf") -> str:
    """``<model><suffix>``, e.g. ``<model>-Q4_0.gguf``, ``<model>-Q4_K_M.gguf``."""
    return model_name(source) + suffix


def _heads_of(hf_name: str, cfg: dict) -> int:
    if ".q_proj" in hf_name:
        return int(cfg["num_attention_heads"])
    return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])


def _target_type(entry: _Entry) -> gguf.GGMLQuantizationType:
    return {**QUANTIZED_KINDS, "norm": F32, "bias": F32, "embedding": EMBEDDING_TYPE,
            "float_linear": FLOAT_LINEAR_TYPE, "router": F32}[entry.kind]


def _tensor_info(entry: _Entry, shape: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype, int]:
    """(numpy shape as stored, numpy dtype as stored, bytes) of one entry, without its data."""
    qtype = _target_type(entry)
    if qtype == F32:
        return shape, np.dtype(np.float32), 4 * math.prod(shape)
    if entry.kind in QUANTIZED_KINDS:  # the part already holds the block bytes
        return shape, np.dtype(np.uint8), math.prod(shape)
    byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
    return byte_shape, np.dtype(np.uint8), math.prod(byte_shape)


def _convert(entry: _Entry, tensor: torch.Tensor, spec: ArchSpec, cfg: dict) -> np.ndarray:
    """One part tensor -> its data as written (rows permuted, norms shifted, types converted)."""
    if spec.rope_permute and re.search(r"\.(q|k)_proj(\.weight|\.bias)?$", entry.hf_name):
        tensor = permute_rope_rows(tensor, _heads_of(entry.hf_name, cfg))
    qtype = _target_type(entry)
    if entry.kind in QUANTIZED_KINDS:
        return tensor.contiguous().numpy()
    t = tensor.to(torch.float32)
    if entry.kind == "norm":
        t = t + spec.norm_shift  # in float32, as HF's Gemma RMSNorm computes 1 + w
    if qtype == F32:
        return t.contiguous().numpy()
    return gguf.quants.quantize(t.contiguous().numpy(), qtype)


def _write_file(path: Path, spec: ArchSpec, cfg: dict, art: ArtifactInfo, entries: list[_Entry],
                fmt: Format, language_prefix: str | None = None) -> None:
    w = gguf.GGUFWriter(path, spec.name)
    w.add_name(model_name(art.source))
    _write_hyperparameters(w, spec, cfg, fmt.llama_file_type)
    _write_tokenizer(w, Path(art.source), cfg, fmt.pre_tokenizer)
    w.add_uint32("cpu_quant.group_size", int(art.default_group))
    w.add_bool("cpu_quant.head_quantized", bool(art.head_quantized))
    if language_prefix is not None:  # a vision-language model's decoder (vision.py)
        w.add_string(LANGUAGE_PREFIX_KEY, language_prefix)
    for e in entries:  # shapes and byte counts first: the header precedes the data
        with safe_open(e.part, "pt") as f:
            shape = e.shape(f)
        np_shape, dtype, nbytes = _tensor_info(e, shape)
        w.add_tensor_info(e.gguf_name, np_shape, dtype, nbytes, raw_dtype=_target_type(e))
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for e in entries:
        with safe_open(e.part, "pt") as f:
            tensor = e.tensor(f)
        w.write_tensor_data(_convert(e, tensor, spec, cfg))
    assert w.fout is not None
    for f in w.fout:
        f.flush()
        os.fsync(f.fileno())
    w.close()
