"""Vision-language checkpoints as llama.cpp runs them: two files.

llama.cpp runs a vision-language model from the language model's GGUF (a decoder like any
other, here the one this package writes for the language model's architecture, with the
calibrated 4-bit linears) and a second file, the projector file ``mmproj-<model>-BF16.gguf``
(architecture ``clip``, ``general.type = mmproj``), which holds the vision tower and the
projector for ``libmtmd`` (``llama-mtmd-cli -m MODEL.gguf --mmproj MMPROJ.gguf --image IMG``).
Both are laid out as llama.cpp's converter writes them (``convert_hf_to_gguf.py``, and the same
with ``--mmproj``): the language model's tensors under their decoder names (the checkpoint's
``model.text_model.`` prefix read as ``model.``), the projector file's tensor names from
gguf-py's ``clip`` name map and its ``clip.*`` metadata from the checkpoint's
``vision_config`` and image processor.

The vision tower and the projector are kept as the checkpoint stores them (cpu-quant never
quantizes them; ``core.vision_language``): 2-D weights in their own type (BF16 for a bf16
checkpoint: the same bits), 1-D tensors and the embeddings (``patch_embd``, ``position_embd``)
in F32 as the converter writes them, which holds bf16 values exactly.

One row per family (:data:`VISION_LANGUAGE`); a vision-language family without a row is
refused in one line before any work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from ...core.errors import CpuQuantError
from ...core.findings import Finding, error, info
from ...core.vision_language import family_of
from .mapped import read_gguf

MMPROJ_PREFIX = "mmproj-"
# the key of the language model's file naming the checkpoint prefix its decoder had, so that
# its modules are named back as the source's (verify --source)
LANGUAGE_PREFIX_KEY = "cpu_quant.language_model_prefix"
_TORCH_TYPES = {torch.bfloat16: gguf.GGMLQuantizationType.BF16,
                torch.float16: gguf.GGMLQuantizationType.F16,
                torch.float32: gguf.GGMLQuantizationType.F32}
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_FILE_TYPES = {gguf.GGMLQuantizationType.BF16: gguf.LlamaFileType.MOSTLY_BF16,
               gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
               gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32}


def _idefics3_keys(w: gguf.GGUFWriter, cfg: dict, vision: dict, processor: dict) -> None:
    # the converter's SmolVLMModel.set_gguf_parameters
    w.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    w.add_vision_attention_layernorm_eps(float(vision.get("layer_norm_eps", 1e-5)))
    w.add_vision_projector_scale_factor(int(cfg.get("scale_factor", 2)))
    w.add_vision_use_gelu(True)
    size = (processor.get("size") or {}).get("longest_edge", int(vision["image_size"]))
    w.add_vision_preproc_image_size(int(size))


@dataclass(frozen=True)
class VisionGGUF:
    """How one vision-language family is written for llama.cpp."""

    language_architecture: str  # the decoder's ``architectures[0]`` in architectures.py
    text_prefix: str  # the checkpoint's prefix of the decoder's tensors, read as "model."
    projector: str  # clip.projector_type (gguf.VisionProjectorType)
    projector_keys: Callable[[gguf.GGUFWriter, dict, dict, dict], None]
    projector_tensors: tuple[str, ...]  # the projector's GGUF tensors that llama.cpp requires
    f32: tuple[str, ...] = (".embeddings.",)  # name parts the converter forces to F32


VISION_LANGUAGE: dict[str, VisionGGUF] = {
    # convert_hf_to_gguf.py: SmolVLMModel (the projector file) for Idefics3ForConditionalGeneration
    # and SmolVLMForConditionalGeneration; the decoder is LlamaModel's ("text_model." dropped)
    "idefics3": VisionGGUF("LlamaForCausalLM", "model.text_model.",
                           gguf.VisionProjectorType.IDEFICS3, _idefics3_keys,
                           ("mm.model.fc.weight",)),
}


def vision_gguf(cfg: dict) -> VisionGGUF | None:
    """The row of a vision-language config.json, or None for a decoder-only model."""
    family = family_of(cfg)
    return None if family is None else VISION_LANGUAGE.get(family.model_type)


def refuse_vision(cfg: dict) -> str | None:
    """Why a vision-language checkpoint cannot be written as GGUF here, or None."""
    family = family_of(cfg)
    if family is None or family.model_type in VISION_LANGUAGE:
        return None
    return (f"{family.name} is a vision-language model whose projector file (mmproj) this "
            "writer has no layout for")


def language_config(cfg: dict) -> dict:
    """The config.json of the language model alone (a decoder-only model's), for the
    architecture map, the hyperparameters and the tokenizer; ``cfg`` itself for a decoder-only
    model."""
    spec = vision_gguf(cfg)
    if spec is None:
        return cfg
    text = dict(cfg.get("text_config") or {})
    text["architectures"] = [spec.language_architecture]
    if "tie_word_embeddings" in cfg:  # the whole model's setting is the one that ties
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def language_name(cfg: dict, hf_name: str) -> str:
    """A checkpoint tensor or module name as the language model's (``model.text_model.X`` ->
    ``model.X``); other names unchanged."""
    spec = vision_gguf(cfg)
    if spec is not None and hf_name.startswith(spec.text_prefix):
        return "model." + hf_name[len(spec.text_prefix):]
    return hf_name


def is_kept(cfg: dict, hf_name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision tower or the projector."""
    family = family_of(cfg)
    return family is not None and family.kept_module(hf_name) is not None


def mmproj_file_name(model: str, dtype: gguf.GGMLQuantizationType) -> str:
    return f"{MMPROJ_PREFIX}{model}-{dtype.name}.gguf"


def processor_config(source: Path) -> dict:
    """The image processor's settings as the converter merges them: preprocessor_config.json,
    then processor_config.json's ``image_processor``."""
    out: dict = {}
    for name, key in (("preprocessor_config.json", "media_proc_cfg"),
                      ("processor_config.json", "image_processor")):
        path = Path(source) / name
        if path.is_file():
            cfg = json.loads(path.read_text(encoding="utf-8"))
            out.update({**cfg, **(cfg.get(key) or {})})
    if "image_mean" not in out or "image_std" not in out:
        raise CpuQuantError(f"gguf: {source} has no image processor config with image_mean and "
                            "image_std (preprocessor_config.json or processor_config.json)")
    return out


def _stored_type(name: str, tensor_dtype: torch.dtype, ndim: int,
                 spec: VisionGGUF) -> gguf.GGMLQuantizationType:
    if ndim <= 1 or any(p in name for p in spec.f32):
        return gguf.GGMLQuantizationType.F32
    qtype = _TORCH_TYPES.get(tensor_dtype)
    if qtype is None:
        raise CpuQuantError(f"gguf: {name} is {tensor_dtype}, not a float type a projector file "
                            "stores")
    return qtype


def _as_numpy(tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return tensor.to(torch.float32).contiguous().numpy()
    if qtype == gguf.GGMLQuantizationType.BF16:  # the bits as they are, as uint8 rows
        raw = tensor.contiguous().view(torch.int16).numpy().view(np.uint8)
        return raw.reshape(*tensor.shape[:-1], tensor.shape[-1] * 2)
    return tensor.to(torch.float16).contiguous().numpy()


def write_mmproj(path: Path, cfg: dict, source: Path, model: str,
                 kept: list[tuple[str, Path]]) -> None:
    """The projector file at ``path`` (written whole, then flushed) from the kept tensors
    ``kept`` (checkpoint name, the part file holding it)."""
    spec = vision_gguf(cfg)
    assert spec is not None
    vision = cfg["vision_config"]
    processor = processor_config(source)
    n_blocks = int(vision["num_hidden_layers"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, n_blocks)
    entries = []  # (GGUF name, checkpoint name, part, stored type); streamed, not held
    for hf, part in sorted(kept):
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CpuQuantError(f"gguf: {hf} has no tensor name in llama.cpp's projector file")
        with safe_open(part, "pt") as f:
            sl = f.get_slice(hf)
            shape, dtype = tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype())
        if dtype is None:
            raise CpuQuantError(f"gguf: {hf} is {sl.get_dtype()}, not a float type a projector "
                                "file stores")
        entries.append((gname, hf, part, shape, _stored_type(hf, dtype, len(shape), spec)))
    linear = [q for _, _, _, shape, q in entries
              if len(shape) == 2 and q != gguf.GGMLQuantizationType.F32]
    file_type = _FILE_TYPES[linear[0] if linear else gguf.GGMLQuantizationType.F32]

    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(model)
    w.add_file_type(file_type)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(int(language_config(cfg)["hidden_size"]))
    w.add_vision_image_size(int(vision["image_size"]))
    w.add_vision_patch_size(int(vision["patch_size"]))
    w.add_vision_embedding_length(int(vision["hidden_size"]))
    w.add_vision_feed_forward_length(int(vision["intermediate_size"]))
    w.add_vision_block_count(n_blocks)
    w.add_vision_head_count(int(vision["num_attention_heads"]))
    w.add_vision_image_mean([float(v) for v in processor["image_mean"]])
    w.add_vision_image_std([float(v) for v in processor["image_std"]])
    spec.projector_keys(w, cfg, vision, processor)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for gname, _, _, shape, qtype in entries:
        size = 4 if qtype == gguf.GGMLQuantizationType.F32 else 2
        np_dtype = {gguf.GGMLQuantizationType.F32: np.float32,
                    gguf.GGMLQuantizationType.F16: np.float16}.get(qtype, np.uint8)
        np_shape = (*shape[:-1], shape[-1] * 2) if np_dtype is np.uint8 else shape
        w.add_tensor_info(gname, np_shape, np.dtype(np_dtype), size * int(np.prod(shape)),
                          raw_dtype=qtype)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, hf, part, _, qtype in entries:
        with safe_open(part, "pt") as f:
            w.write_tensor_data(_as_numpy(f.get_tensor(hf), qtype))
    assert w.fout is not None
    for f in w.fout:
        f.flush()
        os.fsync(f.fileno())
    w.close()


# -- reading it back ------------------------------------------------------------------------------
def mmproj_file_in(directory: Path) -> Path | None:
    """The one projector file of an artifact directory, or None."""
    files = sorted(Path(directory).glob(f"{MMPROJ_PREFIX}*.gguf")) if Path(directory).is_dir() \
        else []
    return files[0] if len(files) == 1 else None


def _value(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


MMPROJ_KEYS = ("general.architecture", "general.type", "clip.has_vision_encoder",
               "clip.projector_type", "clip.vision.projection_dim", "clip.vision.image_size",
               "clip.vision.patch_size", "clip.vision.embedding_length",
               "clip.vision.feed_forward_length", "clip.vision.block_count",
               "clip.vision.attention.head_count", "clip.vision.image_mean",
               "clip.vision.image_std")


def _expected_mmproj(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    """GGUF name -> ggml shape of the tower's tensors llama.cpp needs, from the file's keys."""
    d = int(_value(reader, "clip.vision.embedding_length"))
    ff = int(_value(reader, "clip.vision.feed_forward_length"))
    out = {"v.post_ln.weight": (d,)}
    for i in range(int(_value(reader, "clip.vision.block_count"))):
        out.update({f"v.blk.{i}.attn_{p}.weight": (d, d) for p in ("q", "k", "v", "out")})
        out.update({f"v.blk.{i}.ln1.weight": (d,), f"v.blk.{i}.ln2.weight": (d,),
                    f"v.blk.{i}.ffn_up.weight": (d, ff), f"v.blk.{i}.ffn_down.weight": (ff, d)})
    return out


def verify_mmproj(path: Path) -> list[Finding]:
    """Structural checks of a projector file: the ``clip`` architecture and ``mmproj`` type,
    the keys llama.cpp reads, a projector type with a row here, the tower's tensors with their
    shapes and the projector's, and no data past the end of the file."""
    path = Path(path)
    try:
        reader = read_gguf(path)
    except Exception as e:  # gguf-py raises assorted errors on a damaged header or a short file
        return [error("mmproj-read", path.name, f"unreadable: {type(e).__name__}: {str(e)[:200]}")]
    found = [error("mmproj-metadata", key, "missing") for key in MMPROJ_KEYS
             if reader.get_field(key) is None]
    if found:
        return found
    if _value(reader, "general.architecture") != "clip" or _value(reader, "general.type") != "mmproj":
        return [error("mmproj-arch", path.name, "not a clip projector file (general.type mmproj)")]
    projector = _value(reader, "clip.projector_type")
    spec = next((s for s in VISION_LANGUAGE.values() if s.projector == projector), None)
    if spec is None:
        return [error("mmproj-projector", path.name, f"projector type {projector!r} is not one "
                      "cpu-quant writes")]
    tensors = {t.name: t for t in reader.tensors}
    for name in spec.projector_tensors:
        if name not in tensors:
            found.append(error("mmproj-tensor", name, "missing"))
    for name, shape in _expected_mmproj(reader).items():
        t = tensors.get(name)
        if t is None:
            found.append(error("mmproj-tensor", name, "missing"))
        elif tuple(int(s) for s in t.shape) != shape:
            found.append(error("mmproj-shape", name, f"shape {tuple(int(s) for s in t.shape)}, "
                                                     f"expected {shape}"))
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        found.append(error("mmproj-truncated", path.name, f"data ends at byte {end}, file has "
                                                          f"{path.stat().st_size}"))
    if not found:
        found.append(info("mmproj", path.name, f"projector {projector}: {len(tensors)} tensors "
                          "of the vision tower and projector, kept unquantized"))
    return found


def inspect_mmproj(path: Path) -> dict:
    """The projector file's summary: projector type, tensors and their types, bytes."""
    reader = read_gguf(path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"file": Path(path).name, "projector_type": _value(reader, "clip.projector_type"),
            "tensors": len(reader.tensors), "types": dict(sorted(types.items())),
            "tensor_bytes": sum(int(t.n_bytes) for t in reader.tensors),
            "file_bytes": Path(path).stat().st_size,
            "why": "the vision tower and the projector, kept unquantized"}


def mmproj_tensors(path: Path, cfg: dict, hf_names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """For each checkpoint name of a kept tensor, the projector file's tensor of that name as
    stored (BF16 as bf16, F32 as float32), or None where the file lacks it."""
    reader = read_gguf(path)
    n_blocks = int(cfg["vision_config"]["num_hidden_layers"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, n_blocks)
    tensors = {t.name: t for t in reader.tensors}
    for hf in hf_names:
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        t = tensors.get(gname) if gname else None
        if t is None:
            yield hf, None
            continue
        data = np.array(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            tensor = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(data.astype(np.float32))
        yield hf, tensor
