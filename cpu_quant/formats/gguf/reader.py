"""Reading a GGUF file back: its quantized modules, verify's checks and inspect's summary."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from ...core.block_grid import BlockQuant
from ...core.errors import CpuQuantError
from ...core.findings import Finding, error, info
from ...core.grid import GroupQuant
from .architectures import ARCHITECTURES, LINEARS, ArchSpec, _head_dim, unpermute_rope_rows
from .block_types import QUANT_TYPES
from .experts import expected_moe_tensors, expert_modules, unstack
from .mapped import read_gguf
from .q4_0 import BLOCK_BYTES, F32, Q4_0, unpack_q4_0
from .vision import LANGUAGE_PREFIX_KEY, MMPROJ_PREFIX


def quantized_types() -> set[gguf.GGMLQuantizationType]:
    """Every quantized type this package reads back: Q4_0 and the block types."""
    return {Q4_0, *QUANT_TYPES}


def unpack_tensor(qtype: gguf.GGMLQuantizationType, blocks: torch.Tensor) -> GroupQuant | BlockQuant:
    """A quantized tensor's rows of bytes [N, bytes] -> its codes and scales."""
    if qtype == Q4_0:
        return unpack_q4_0(blocks)
    return QUANT_TYPES[qtype].unpack(blocks)


def _scales_finite(qtype: gguf.GGMLQuantizationType, blocks: np.ndarray) -> int:
    """How many stored float16 scales and mins of a quantized tensor are not finite."""
    if qtype == Q4_0:
        d = blocks.reshape(-1, BLOCK_BYTES)[:, :2].copy().view(np.float16)
        return int((~np.isfinite(d)).sum())
    fixed = QUANT_TYPES[qtype].unpack(torch.from_numpy(blocks.reshape(1, -1).copy())).fixed
    return sum(int((~torch.isfinite(t)).sum()) for t in (fixed.d, fixed.dmin) if t is not None)


def _field_value(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _hf_module_names(spec: ArchSpec, n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF module name, for every linear the architecture has."""
    names = gguf.get_tensor_name_map(spec.arch, n_layers)
    modules = [f"model.layers.{i}.{m}" for i in range(n_layers) for m in LINEARS] + ["lm_head"]
    out = {}
    for m in modules:
        g = names.get_name(m + ".weight", try_suffixes=(".weight",))
        if g is not None:
            out[g] = m
    return out


def _reader_config(reader: gguf.GGUFReader) -> tuple[ArchSpec, dict]:
    arch = _field_value(reader, "general.architecture")
    spec = next((s for s in ARCHITECTURES.values() if s.name == arch), None)
    if spec is None:
        raise CpuQuantError(f"gguf: architecture {arch!r} is not one cpu-quant writes")
    cfg = {"num_hidden_layers": int(_field_value(reader, f"{arch}.block_count")),
           "num_attention_heads": int(_field_value(reader, f"{arch}.attention.head_count")),
           "num_key_value_heads": int(_field_value(reader, f"{arch}.attention.head_count_kv"))}
    return spec, cfg


def _open(path: Path) -> gguf.GGUFReader:
    try:
        return read_gguf(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise CpuQuantError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0][:200]})") from None


def _undo_rows(spec: ArchSpec, cfg: dict, module: str, rows: torch.Tensor) -> torch.Tensor:
    if spec.rope_permute and module.endswith(("q_proj", "k_proj")):
        heads = cfg["num_attention_heads"] if module.endswith("q_proj") else cfg["num_key_value_heads"]
        return unpermute_rope_rows(rows, int(heads))
    return rows


def unpack(path: Path) -> dict[str, GroupQuant | BlockQuant]:
    """Every quantized linear of a GGUF file, by HF module name, in Hugging Face row order
    (llama's rope permutation undone): Q4_0 as a group-32 :class:`GroupQuant` (compare with
    the quantizer's result through :func:`as_blocks_of_32`: a group of 128 reads back as four
    blocks of 32), the block types as a :class:`BlockQuant`."""
    reader = _open(Path(path))
    spec, cfg = _reader_config(reader)
    modules = _hf_module_names(spec, cfg["num_hidden_layers"])
    if head_is_token_embd(reader):
        modules["token_embd.weight"] = "lm_head"
    experts = expert_modules(gguf.get_tensor_name_map(spec.arch, cfg["num_hidden_layers"]),
                             cfg["num_hidden_layers"])
    out = {}
    for t in reader.tensors:
        if t.tensor_type == Q4_0 and t.name in experts:  # stacked: one module per expert
            stacked = torch.from_numpy(np.array(t.data)).reshape(int(t.shape[2]), int(t.shape[1]), -1)
            for e, blocks in enumerate(unstack(stacked)):
                out[experts[t.name].format(e)] = unpack_q4_0(blocks)
            continue
        if t.tensor_type not in quantized_types() or t.name not in modules:
            continue
        blocks = torch.from_numpy(np.array(t.data)).reshape(int(t.shape[1]), -1)
        module = modules[t.name]
        out[module] = unpack_tensor(t.tensor_type, _undo_rows(spec, cfg, module, blocks))
    prefix = _field_value(reader, LANGUAGE_PREFIX_KEY)  # a vision-language model's decoder
    if prefix:
        out = {prefix + m.removeprefix("model.") if m.startswith("model.") else m: gq
               for m, gq in out.items()}
    return out


def head_is_token_embd(reader: gguf.GGUFReader) -> bool:
    """A tied file whose one ``token_embd`` is the quantized head (a llama.cpp file type
    written from a tied source): the head quantized, and no ``output`` tensor."""
    return bool(_field_value(reader, "cpu_quant.head_quantized")) and not any(
        t.name == "output.weight" for t in reader.tensors)


def expected_tensors(spec: ArchSpec, cfg: dict, head_in_file: bool) -> dict[str, tuple[int, ...]]:
    """GGUF name -> ggml shape ``ne`` of every tensor the architecture needs (biases aside)."""
    n_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    hd, heads = _head_dim(cfg), int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    ff, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden,)}
    if head_in_file:
        out["output.weight"] = (hidden, vocab)
    per = {"attn_q": (hidden, heads * hd), "attn_k": (hidden, kv * hd), "attn_v": (hidden, kv * hd),
           "attn_output": (heads * hd, hidden), "ffn_gate": (hidden, ff), "ffn_up": (hidden, ff),
           "ffn_down": (ff, hidden), "attn_norm": (hidden,)}
    if spec.arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        per.update({"post_attention_norm": (hidden,), "ffn_norm": (hidden,), "post_ffw_norm": (hidden,)})
    else:
        per["ffn_norm"] = (hidden,)
    if spec.arch in (gguf.MODEL_ARCH.QWEN3, gguf.MODEL_ARCH.GEMMA3, gguf.MODEL_ARCH.QWEN3MOE):
        per.update({"attn_q_norm": (hd,), "attn_k_norm": (hd,)})
    if spec.arch == gguf.MODEL_ARCH.QWEN3MOE:  # the experts and the router, no dense MLP
        for k in ("ffn_gate", "ffn_up", "ffn_down"):
            del per[k]
        per.update(expected_moe_tensors(cfg))
    for i in range(n_layers):
        out.update({f"blk.{i}.{k}.weight": v for k, v in per.items()})
    return out


REQUIRED_KEYS = ("general.architecture", "general.file_type", "{arch}.context_length",
                 "{arch}.embedding_length", "{arch}.block_count", "{arch}.feed_forward_length",
                 "{arch}.attention.head_count", "{arch}.attention.head_count_kv",
                 "{arch}.attention.layer_norm_rms_epsilon", "tokenizer.ggml.model",
                 "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


def _check_file_size(path: Path) -> Iterator[Finding]:
    data = path.read_bytes()[:8] if path.stat().st_size >= 8 else b""
    if data[:4] != b"GGUF":
        yield error("gguf-magic", path.name, f"magic {data[:4]!r} is not b'GGUF'")
    elif int.from_bytes(data[4:8], "little") != 3:
        yield error("gguf-version", path.name, f"version {int.from_bytes(data[4:8], 'little')} is not 3")


def _config_from_file(reader: gguf.GGUFReader, arch: str) -> dict:
    def get(key, default=None):
        v = _field_value(reader, f"{arch}.{key}")
        return default if v is None else v

    hidden, heads = get("embedding_length"), get("attention.head_count")
    tokens = _field_value(reader, "tokenizer.ggml.tokens")
    return {"num_hidden_layers": get("block_count", 0), "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": get("attention.head_count_kv", heads),
            "head_dim": get("attention.key_length", hidden // heads if hidden and heads else None),
            "intermediate_size": get("feed_forward_length"),
            "num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "vocab_size": len(tokens) if tokens is not None else get("vocab_size")}


def verify(path: Path, source_config: dict | None = None) -> list[Finding]:
    """Structural checks of a GGUF file; errors say why it is refused.

    Magic and version; the tensors llama.cpp needs for the architecture, each with the right
    shape (against ``source_config`` when given, else the file's own hyperparameters) and type
    (F32 for norms); every stored float16 scale and min of a quantized tensor (Q4_0 and the
    block types) finite; the metadata keys present; and
    that the data ends where the file does (a truncated file is refused).
    """
    path = Path(path)
    found = list(_check_file_size(path))
    if found:
        return found
    try:
        reader = read_gguf(path)
    except Exception as e:  # gguf-py raises assorted errors on a damaged header or a short file
        return [error("gguf-read", path.name, f"unreadable: {type(e).__name__}: {str(e)[:200]}")]
    arch = _field_value(reader, "general.architecture")
    spec = next((s for s in ARCHITECTURES.values() if s.name == arch), None)
    if spec is None:
        return [error("gguf-arch", path.name, f"architecture {arch!r} is not one cpu-quant writes")]
    for key in REQUIRED_KEYS:
        if reader.get_field(key.format(arch=arch)) is None:
            found.append(error("gguf-metadata", key.format(arch=arch), "missing"))
    cfg = source_config if source_config else _config_from_file(reader, arch)
    tensors = {t.name: t for t in reader.tensors}
    expected = expected_tensors(spec, cfg, head_in_file="output.weight" in tensors)
    end = 0
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            found.append(error("gguf-tensor", name, "missing"))
            continue
        if tuple(int(s) for s in t.shape) != shape:
            got = tuple(int(s) for s in t.shape)
            found.append(error("gguf-shape", name, f"shape {got}, expected {shape}"))
        if name.endswith(("norm.weight", "ffn_gate_inp.weight")) and t.tensor_type != F32:
            found.append(error("gguf-type", name, f"{t.tensor_type.name}, expected F32"))
        if t.tensor_type in quantized_types():
            bad = _scales_finite(t.tensor_type, np.ascontiguousarray(t.data))
            if bad:
                found.append(error("gguf-scale", name, f"{bad} non-finite scale(s) "
                                                       f"({t.tensor_type.name})"))
    for t in reader.tensors:
        end = max(end, int(t.data_offset) + int(t.n_bytes))
    if end > path.stat().st_size:
        found.append(error("gguf-truncated", path.name, f"data ends at byte {end}, file has "
                                                        f"{path.stat().st_size}"))
    if not any(f.severity == "error" for f in found):
        types = Counter(t.tensor_type.name for t in reader.tensors
                        if t.tensor_type in quantized_types())
        found.append(info("gguf", path.name, f"{arch}: {len(tensors)} tensors, " + ", ".join(
            f"{n} {name}" for name, n in sorted(types.items()))))
        experts = _experts_summary(reader)
        if experts:
            found.append(info("gguf-experts", path.name, f"experts {experts['experts']}; kept "
                                                         f"{experts['kept_float']}"))
    return found


def inspect(path: Path) -> dict:
    """A summary: architecture, file type, tensor count, types histogram, bits per weight of
    the decoder layers' quantized tensors and of the whole file, sizes."""
    path = Path(path)
    reader = _open(path)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    q = [t for t in reader.tensors
         if t.tensor_type in quantized_types() and t.name.startswith("blk.")]
    q_weights = sum(int(t.n_elements) for t in q)
    all_weights = sum(int(t.n_elements) for t in reader.tensors)
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    return {"architecture": _field_value(reader, "general.architecture"),
            "tensors": len(reader.tensors), "types": dict(sorted(types.items())),
            "file_type": _file_type_name(_field_value(reader, "general.file_type")),
            "layer_bits_per_weight": (8 * sum(int(t.n_bytes) for t in q) / q_weights)
            if q_weights else None,
            "bits_per_weight": 8 * tensor_bytes / all_weights if all_weights else math.nan,
            "weights": all_weights, "tensor_bytes": tensor_bytes, "file_bytes": path.stat().st_size,
            "pre_tokenizer": _field_value(reader, "tokenizer.ggml.pre"), **_experts_summary(reader)}


def _experts_summary(reader: gguf.GGUFReader) -> dict:
    """A mixture-of-experts file's experts, and what stays float: the router."""
    arch = _field_value(reader, "general.architecture")
    n = _field_value(reader, f"{arch}.expert_count")
    if not n:
        return {}
    routers = [t for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")]
    types = sorted({t.tensor_type.name for t in routers})
    return {"experts": f"{n} per layer, {_field_value(reader, f'{arch}.expert_used_count')} "
                       f"per token, stacked in ffn_*_exps",
            "kept_float": f"the router (ffn_gate_inp, {', '.join(types)}, {len(routers)} "
                          "layers): it picks the experts"}


def _file_type_name(value) -> str | None:
    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return None


def gguf_file_in(path: Path) -> Path | None:
    """``path`` itself when it is a ``.gguf`` file; the one model ``.gguf`` file of a directory
    (a vision-language model's projector file, ``mmproj-*.gguf``, beside it); None."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(p for p in path.glob("*.gguf") if not p.name.startswith(MMPROJ_PREFIX))
        return files[0] if len(files) == 1 else None
    return None
