"""Reading Hugging Face checkpoints at the edge: validated, lazy, never unpickling.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` when sharded). Tensors are read lazily through memory-mapped
``safe_open`` handles, one at a time, so a model larger than RAM can stream through.

Refused with a one-line error: a missing directory or config, pickle checkpoints
(``.bin``/``.pt``/``.pth``: loading them can execute code), a safetensors header that is not
valid JSON or claims more bytes than the file holds, and an index that names missing files.
NaN/Inf are checked per tensor as it is read (``Checkpoint.tensor(..., check_finite=True)``).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CpuQuantError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HEADER_LIMIT = 100 * 1024 * 1024
SAMPLE_BYTES = 4096  # per sample of a tensor's data in content_digest
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
INTEGER_DTYPES = ("BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64")


def read_safetensors_header(path: Path) -> dict:
    """Parse and validate a safetensors header without touching the data."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CpuQuantError(f"{path.name}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > HEADER_LIMIT or 8 + n > size:
            raise CpuQuantError(f"{path.name}: safetensors header claims {n} bytes, "
                                f"the file has {size}")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CpuQuantError(f"{path.name}: corrupted safetensors header") from None
    if not isinstance(header, dict):
        raise CpuQuantError(f"{path.name}: corrupted safetensors header")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            shape, dtype = list(info["shape"]), info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise CpuQuantError(f"{path.name}: tensor {name} has no valid data_offsets, shape "
                                "and dtype") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (start, end, *shape)):
            raise CpuQuantError(f"{path.name}: tensor {name} has a malformed shape or offsets")
        if not (0 <= start <= end <= data_len):
            raise CpuQuantError(f"{path.name}: tensor {name} claims bytes {start}..{end}, "
                                f"the file holds {data_len} (truncated?)")
        if dtype not in DTYPE_BYTES:
            raise CpuQuantError(f"{path.name}: tensor {name} has an unknown dtype {dtype!r}")
        expected = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - start != expected:
            raise CpuQuantError(f"{path.name}: tensor {name} ({dtype} {shape}) needs {expected} "
                                f"bytes, its offsets give {end - start} (corrupted header)")
    return header


# sizes a config states as positive integers (transformers divides by some of them)
POSITIVE_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim",
                        "max_position_embeddings")


def config_value_problem(config: dict) -> str | None:
    """Why a config's sizes are unusable (a size that is not a positive integer, in the config
    or its ``text_config``), or None. An absent or null key is left to the model's default."""
    for where, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for key in POSITIVE_CONFIG_KEYS:
            value = cfg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                return f"{where}{key} must be a positive integer, not {value!r}"
    return None


def integer_weights(ckpt: Checkpoint) -> list[str]:
    """The ``*.weight`` tensors stored as integers (an already-quantized or foreign checkpoint)."""
    return [n for n in ckpt.names if n.endswith(".weight") and ckpt.dtype(n) in INTEGER_DTYPES]


def check_float_weights(ckpt: Checkpoint) -> None:
    """Refuse a checkpoint with integer weights: read as a float model, they would be cast to
    float without a word."""
    ints = integer_weights(ckpt)
    if ints:
        raise CpuQuantError(f"tensor {ints[0]} is {ckpt.dtype(ints[0])} ({len(ints)} integer "
                            "weights): a floating-point checkpoint (bf16, fp16, fp32) is needed, "
                            "not an already-quantized one")


def load_hf_config(root: str | Path):
    """transformers' config of a checkpoint directory (never repository code), or a one-line
    error."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(root, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for unknown configs
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CpuQuantError(f"cannot read the model config of {root}: {first}") from None


def empty_causal_lm(config, dtype: torch.dtype):
    """A causal LM of ``config`` without memory (accelerate's empty weights), or a one-line
    error for an architecture transformers cannot build."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        try:
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CpuQuantError(f"unsupported model: {first}") from None


def tensors_disagree(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], tied: bool
                     ) -> str | None:
    """How a checkpoint's tensors (name -> shape) disagree with the model its config builds
    (a missing, unexpected or mis-shaped tensor), or None. A tied head needs no tensor of its
    own; rotary ``inv_freq`` buffers some checkpoints carry are ignored."""
    params = dict(model.named_parameters())
    buffers = {n for n, _ in model.named_buffers()}
    missing = [n for n in params if n not in shapes and not (n == "lm_head.weight" and tied)]
    if missing:
        return f"{missing[0]} is missing ({len(missing)} missing in all)"
    extra = sorted(n for n in shapes if n not in params and n not in buffers
                   and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        return f"unexpected tensor {extra[0]} ({len(extra)} unexpected in all)"
    for n, p in params.items():
        if n in shapes and tuple(p.shape) != tuple(shapes[n]):
            return f"{n} has shape {list(shapes[n])}, the config implies {list(p.shape)}"
    return None


def model_context(config: dict) -> int | None:
    """``max_position_embeddings`` of a config (or of its ``text_config``), when it is stated."""
    for cfg in (config, config.get("text_config")):
        value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def load_tokenizer(root: str | Path):
    """The checkpoint's tokenizer, or a one-line error. A tokenizer that names repository code
    (``auto_map``) is refused: cpu-quant never runs it."""
    from transformers import AutoTokenizer

    cfg = Path(root) / "tokenizer_config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            raise CpuQuantError(f"{cfg}: not valid JSON; the tokenizer cannot be loaded") from None
        if isinstance(data, dict) and data.get("auto_map"):
            raise CpuQuantError(f"{cfg} names repository code (auto_map); cpu-quant never runs "
                                "it: give the checkpoint a standard tokenizer")
    try:
        return AutoTokenizer.from_pretrained(root, trust_remote_code=False)
    except Exception as exc:  # transformers and tokenizers raise many types for a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CpuQuantError(f"cannot load the tokenizer of {root}: {first}") from None


def _inside(base: Path, path: Path) -> bool:
    """Does ``path`` resolve inside ``base``? A Hugging Face hub snapshot's links into its
    repository's ``blobs`` directory count as inside."""
    roots = [base.resolve()]
    if base.parent.name == "snapshots":
        roots.append((base.parent.parent / "blobs").resolve())
    target = path.resolve()
    return any(target == r or r in target.parents for r in roots)


@dataclass
class Checkpoint:
    """A validated checkpoint directory with lazy tensor access."""

    path: Path
    config: dict
    files: dict[str, Path]  # tensor name -> file
    headers: dict[Path, dict] = field(repr=False)
    _handles: dict = field(default_factory=dict, repr=False)

    @property
    def names(self) -> list[str]:
        return list(self.files)

    def info(self, name: str) -> dict:
        return self.headers[self.files[name]][name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.info(name)["shape"])

    def dtype(self, name: str) -> str:
        return self.info(name)["dtype"]

    def tensor(self, name: str, check_finite: bool = False) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(str(file), framework="pt")
            self._handles[file] = handle
        t = handle.get_tensor(name)
        if check_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CpuQuantError(f"tensor {name} contains NaN or Inf values")
        return t

    def close(self) -> None:
        self._handles.clear()

    def content_digest(self) -> str:
        """SHA-256 over every safetensors file's name, size and header, and over sampled
        bytes of every tensor: ``SAMPLE_BYTES`` at the start, the middle and the end of its
        data. Hashing whole shards would read the model once more on every start and every
        resume (16 GB for an 8B model: minutes on a disk); the samples are three small reads
        per tensor (about 3.5 MB for an 8B model). Any retrained, fine-tuned or re-initialised
        model changes the bytes everywhere, so the samples tell it apart; a change confined
        to bytes outside the samples (one hand-edited weight) is not seen."""
        h = hashlib.sha256()
        for f in sorted(self.headers, key=lambda p: p.name):
            header = self.headers[f]
            h.update(json.dumps([f.name, f.stat().st_size, header], sort_keys=True).encode())
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                base = 8 + n
                for name in sorted(k for k in header if k != "__metadata__"):
                    start, end = header[name]["data_offsets"]
                    for off in sorted({start, (start + end) // 2, max(start, end - SAMPLE_BYTES)}):
                        fh.seek(base + off)
                        h.update(fh.read(min(SAMPLE_BYTES, end - off)))
        return h.hexdigest()


def open_checkpoint(path: str | Path) -> Checkpoint:
    root = Path(path)
    if not root.exists():
        raise CpuQuantError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise CpuQuantError(f"{root} is not a directory (expected a Hugging Face checkpoint)")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CpuQuantError(f"{root} has no config.json")
    if not _inside(root, cfg_path):
        raise CpuQuantError(f"{cfg_path} points outside the checkpoint directory")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CpuQuantError(f"{cfg_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CpuQuantError(f"{cfg_path}: expected a JSON object")
    problem = config_value_problem(config)
    if problem:
        raise CpuQuantError(f"{cfg_path}: {problem}")
    for other in root.iterdir():
        if other.is_file() and not _inside(root, other):
            raise CpuQuantError(f"{other.name} points outside the checkpoint directory")
    st_files = sorted(root.glob("*.safetensors"))
    if not st_files:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CpuQuantError(f"{root} holds only pickle weights ({pickles[0]}); cpu-quant "
                                "never unpickles checkpoints: convert them to safetensors first")
        raise CpuQuantError(f"{root} holds no .safetensors files")
    headers = {f: read_safetensors_header(f) for f in st_files}
    files: dict[str, Path] = {}
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise CpuQuantError(f"{index.name}: no valid weight_map") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                       for v in weight_map.values()):
            raise CpuQuantError(f"{index.name}: weight_map must map tensor names to file names")
        for name, fname in weight_map.items():
            f = root / fname
            if not _inside(root, f) or f not in headers:
                raise CpuQuantError(f"{index.name}: {name} points to missing or outside file {fname}")
            if name not in headers[f]:
                raise CpuQuantError(f"{index.name}: {name} is not in {fname}")
            files[name] = f
    else:
        for f, header in headers.items():
            for name in header:
                if name != "__metadata__":
                    files[name] = f
    return Checkpoint(root, config, files, headers)
