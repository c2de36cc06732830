"""Reading Hugging Face checkpoints at the edge: validated, lazy, never unpickling.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` when sharded). Tensors are read lazily through memory-mapped
``safe_open`` handles, one at a time, so a model larger than RAM can stream through.

Refused with a one-line error: a missing directory or config, pickle checkpoints
(``.bin``/``.pt``/``.pth``: loading them can execute code), a symlink loop or a non-regular
file where a file is read (a FIFO would block the read forever), JSON nested deeper than the
parser recurses, a safetensors header that is not valid JSON, claims more bytes than the file
holds, or whose tensors share bytes, leave bytes of the file to no tensor or run past it (the
safetensors library itself refuses such a file, with an exception), a tensor stored in two
shards, and an index that names missing files.
NaN/Inf are checked per tensor as it is read (``Checkpoint.tensor(..., check_finite=True)``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CpuQuantError
from ..vision_language import auto_class, family_of

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HEADER_LIMIT = 100 * 1024 * 1024
SAMPLE_BYTES = 4096  # per sample of a tensor's data in content_digest
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
INTEGER_DTYPES = ("BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64")
# fp8 checkpoints store weights divided by per-block scales (weight_scale_inv tensors): read as
# floats, the weights would be wrong by those scales without a word
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
# The largest |value| a tensor may hold (read with check_finite): fp16's largest. No fp16
# checkpoint can hold more, every fp16 consumer overflows beyond it, and the quantizers square
# weights and weight them by E[x²] in float32 (3e38 overflows there). Trained models stay far
# inside it (the demo model's largest weight is 9.25).
MAX_WEIGHT = 65504.0


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file (a symlink loop, missing, a directory, a FIFO or
    another non-regular file), or None. Opening a FIFO blocks until something writes to it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "is a link to a missing file" if path.is_symlink() else "does not exist"
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISDIR(mode):
        return "is a directory, not a regular file"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a FIFO, socket or device)"
    return None


def parse_json(text: str | bytes, where: str) -> object:
    """``json.loads``, with JSON nested deeper than the parser's recursion refused in one line
    (``json`` recurses once per level: 100,000 brackets raise RecursionError). Other
    malformations raise ``ValueError`` as ``json.loads`` does, for the caller to phrase."""
    try:
        return json.loads(text)
    except RecursionError:
        raise CpuQuantError(f"{where}: JSON nested too deeply to parse") from None


def read_json_file(path: Path, where: str | None = None) -> object:
    """A JSON file's value, or a one-line error naming the file: not a regular file, unreadable,
    not UTF-8, not JSON, or nested too deeply."""
    where = where or str(path)
    problem = file_problem(path)
    if problem:
        raise CpuQuantError(f"{where} {problem}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CpuQuantError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise CpuQuantError(f"{where}: not valid JSON (not UTF-8)") from None
    try:
        return parse_json(text, where)
    except ValueError as exc:
        raise CpuQuantError(f"{where}: not valid JSON ({exc})") from None


def read_safetensors_header(path: Path) -> dict:
    """Parse and validate a safetensors header without touching the data."""
    problem = file_problem(path)
    if problem:
        raise CpuQuantError(f"{path.name} {problem}")
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
            header = parse_json(fh.read(n), f"{path.name}: safetensors header")
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
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
    problem = layout_problem(header, data_len)
    if problem:
        raise CpuQuantError(f"{path.name}: {problem}")
    return header


def layout_problem(header: dict, data_len: int) -> str | None:
    """How the tensors' byte ranges fail to tile the data section exactly (the safetensors
    library's own rule: sorted by offset, each starts where the one before ends, the last
    ends at the end of the file), or None. Overlaps are named first: two tensors sharing
    bytes also leave a gap elsewhere, and the overlap is the fault."""
    spans = sorted((tuple(info["data_offsets"]), name) for name, info in header.items()
                   if name != "__metadata__")
    reach, furthest = 0, None  # the furthest end so far, and whose it is
    for (start, end), name in spans:
        if furthest is not None and start < reach:
            return f"tensors {furthest} and {name} share bytes (overlapping offsets)"
        if end > reach:
            reach, furthest = end, name
    covered = 0
    for (start, end), name in spans:
        if start != covered:
            return f"bytes {covered}..{start} before tensor {name} belong to no tensor"
        covered = end
    if covered != data_len:
        return (f"{data_len - covered} bytes after the last tensor belong to no tensor "
                "(appended to, or a corrupted header)")
    return None


# sizes a config states as positive integers (transformers divides by some of them)
POSITIVE_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim",
                        "max_position_embeddings")


# norm epsilons: added under a square root (a NaN or a negative one makes NaN activations)
EPSILON_CONFIG_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")


def config_value_problem(config: dict) -> str | None:
    """Why a config's values are unusable (a size that is not a positive integer, a norm
    epsilon that is not a finite number >= 0, in the config or its ``text_config``), or None.
    An absent or null key is left to the model's default."""
    for where, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for key in POSITIVE_CONFIG_KEYS:
            value = cfg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                return f"{where}{key} must be a positive integer, not {value!r}"
        for key in EPSILON_CONFIG_KEYS:
            value = cfg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not math.isfinite(value) or value < 0):
                return f"{where}{key} must be a finite number >= 0, not {value!r}"
    return None


DECODER_LAYER = re.compile(r"model\.layers\.(\d+)\.")
EMBEDDING = "model.embed_tokens.weight"


def config_size_problem(config: dict, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """How the config's vocabulary or depth disagrees with the tensors (name -> shape)
    of a Llama-style checkpoint (``model.embed_tokens``, ``model.layers.N``), or None.

    Arithmetic on the header only, so a config that states a billion layers or a vocabulary
    of a trillion tokens is refused before a model is built from it (building one hangs or
    allocates terabytes); the full comparison, tensor by tensor, comes after the build. More layers on
    disk than the config states are left to it (some checkpoints carry extra prediction
    layers); a checkpoint named otherwise is not checked here. A vision-language family's
    language model is checked the same way under its own prefix, against its ``text_config``."""
    family = family_of(config)
    embedding, decoder_layer, where = EMBEDDING, DECODER_LAYER, ""
    if family is not None and isinstance(config.get("text_config"), dict):
        config, where = config["text_config"], "text_config."
        embedding = f"{family.language_model}.embed_tokens.weight"
        decoder_layer = re.compile(re.escape(family.layers) + r"\.(\d+)\.")
    embed = shapes.get(embedding)
    value = config.get("vocab_size")
    if embed and isinstance(value, int) and value != embed[0]:
        return f"{where}vocab_size is {value}, {embedding} has shape {list(embed)}"
    layers = {int(m.group(1)) for n in shapes if (m := decoder_layer.match(n))}
    value = config.get("num_hidden_layers")
    if layers and isinstance(value, int) and value > len(layers):
        return f"{where}num_hidden_layers is {value}, the checkpoint holds {len(layers)} layers"
    return None


def check_config_sizes(ckpt: Checkpoint) -> None:
    """Refuse, before a model is built, a config whose sizes the tensors contradict
    (:func:`config_size_problem`)."""
    problem = config_size_problem(ckpt.config, {n: ckpt.shape(n) for n in ckpt.names})
    if problem:
        raise CpuQuantError(f"config disagrees with the tensors: {problem}")


def integer_weights(ckpt: Checkpoint) -> list[str]:
    """The ``*.weight`` tensors stored as integers (an already-quantized or foreign checkpoint)."""
    return [n for n in ckpt.names if n.endswith(".weight") and ckpt.dtype(n) in INTEGER_DTYPES]


def check_float_weights(ckpt: Checkpoint) -> None:
    """Refuse a checkpoint with integer weights (read as a float model, they would be cast to
    float without a word) or with fp8 tensors (their values are scaled, ``FP8_DTYPES``)."""
    ints = integer_weights(ckpt)
    if ints:
        raise CpuQuantError(f"tensor {ints[0]} is {ckpt.dtype(ints[0])} ({len(ints)} integer "
                            "weights): a floating-point checkpoint (bf16, fp16, fp32) is needed, "
                            "not an already-quantized one")
    fp8 = [n for n in ckpt.names if ckpt.dtype(n) in FP8_DTYPES]
    if fp8:
        raise CpuQuantError(f"tensor {fp8[0]} is {ckpt.dtype(fp8[0])} ({len(fp8)} fp8 tensors): "
                            "a bf16, fp16 or fp32 checkpoint is needed; fp8 weights are stored "
                            "divided by block scales that cpu-quant does not apply")


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
    error for an architecture transformers cannot build. A vision-language family's whole
    model is built by its own auto class (``vision_language.FAMILIES``). A mixture-of-experts
    model's fused experts are put back as one linear per expert projection, named as the
    checkpoint's tensors (``core.experts``)."""
    import transformers
    from accelerate import init_empty_weights

    from ..experts import unfuse_experts

    auto = getattr(transformers, auto_class(config))
    with init_empty_weights(include_buffers=False):
        try:
            model = auto.from_config(config, dtype=dtype)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CpuQuantError(f"unsupported model: {first}") from None
    unfuse_experts(model)
    return model


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

    check_no_special_files(Path(root))
    cfg = Path(root) / "tokenizer_config.json"
    if cfg.is_file():
        try:
            data = parse_json(cfg.read_text(encoding="utf-8"), str(cfg))
        except (ValueError, OSError):
            raise CpuQuantError(f"{cfg}: not valid JSON; the tokenizer cannot be loaded") from None
        if isinstance(data, dict) and data.get("auto_map"):
            raise CpuQuantError(f"{cfg} names repository code (auto_map); cpu-quant never runs "
                                "it: give the checkpoint a standard tokenizer")
        if isinstance(data, dict) and data.get("tokenizer_class") is not None:
            check_tokenizer_class(data["tokenizer_class"], cfg)
    try:
        return AutoTokenizer.from_pretrained(root, trust_remote_code=False)
    except Exception as exc:  # transformers and tokenizers raise many types for a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CpuQuantError(f"cannot load the tokenizer of {root}: {first}") from None


def check_tokenizer_class(name: object, cfg: Path) -> None:
    """Refuse a ``tokenizer_class`` transformers does not know: it falls back to a generic
    tokenizer without a word, which may split text differently from the model's own."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    # a slow class name ("LlamaTokenizer") and its fast twin ("...Fast") are both standard
    known = isinstance(name, str) and any(
        tokenizer_class_from_name(n) is not None for n in (name, name.removesuffix("Fast")))
    if not known:
        raise CpuQuantError(f"{cfg} names tokenizer class {name!r}, which transformers does "
                            "not know; the tokenizer cannot be loaded as the model's own")


def check_no_special_files(root: Path) -> None:
    """Refuse a FIFO, socket or device in a checkpoint directory: transformers opens the
    tokenizer files it finds by name, and reading a FIFO blocks until something writes to it."""
    for entry in sorted(root.iterdir()):
        try:
            mode = os.stat(entry).st_mode
        except OSError:  # a dangling link or a loop: opening it fails at once, in one line
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CpuQuantError(f"{entry} is not a regular file (a FIFO, socket or device)")


def _inside(base: Path, path: Path) -> bool:
    """Does ``path`` resolve inside ``base``? A Hugging Face hub snapshot's links into its
    repository's ``blobs`` directory count as inside."""
    try:
        roots = [base.resolve()]
        if base.parent.name == "snapshots":
            roots.append((base.parent.parent / "blobs").resolve())
        target = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        return False
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

    def _handle(self, name: str):
        """The open safetensors file holding ``name`` (opened once)."""
        from safetensors import safe_open

        file = self.files[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(str(file), framework="pt")
            self._handles[file] = handle
        return handle

    def tensor(self, name: str, check_finite: bool = False) -> torch.Tensor:
        t = self._handle(name).get_tensor(name)
        if check_finite and t.is_floating_point() and t.numel():
            # one pass, no copy of the tensor; both are NaN if any element is
            lo, hi = (float(v) for v in torch.aminmax(t))
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise CpuQuantError(f"tensor {name} contains NaN or Inf values")
            largest = max(-lo, hi)
            if largest > MAX_WEIGHT:
                raise CpuQuantError(f"tensor {name} holds {largest:.3g}, beyond fp16's range "
                                    f"(|w| <= {MAX_WEIGHT:g}): a corrupted weight; fp16 runtimes "
                                    "and the quantizers' float32 error terms overflow on it")
        return t

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of a 2-D tensor, each read on its own (the rest stays on disk)."""
        part = self._handle(name).get_slice(name)
        rows = [part[i:i + 1] for i in index.tolist()]
        return torch.cat(rows) if rows else self.tensor(name)[:0]

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


def check_checkpoint_dir(root: Path) -> None:
    """Refuse a checkpoint path that is not a directory: missing, a symlink loop, a file."""
    try:
        mode = os.stat(root).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CpuQuantError(f"checkpoint directory {root} is a symlink loop") from None
        raise CpuQuantError(f"checkpoint directory {root} does not exist") from None
    if not stat.S_ISDIR(mode):
        raise CpuQuantError(f"{root} is not a directory (expected a Hugging Face checkpoint)")


def read_config(root: Path) -> dict:
    """``root/config.json``, validated (:func:`config_value_problem`), or a one-line error.
    The one reader of a source's config: every command refuses the same faults the same way."""
    check_checkpoint_dir(root)
    cfg_path = root / "config.json"
    problem = file_problem(cfg_path)
    if problem == "does not exist":
        raise CpuQuantError(f"{root} has no config.json")
    if problem:
        raise CpuQuantError(f"{cfg_path} {problem}")
    if not _inside(root, cfg_path):
        raise CpuQuantError(f"{cfg_path} points outside the checkpoint directory")
    config = read_json_file(cfg_path)
    if not isinstance(config, dict):
        raise CpuQuantError(f"{cfg_path}: expected a JSON object")
    problem = config_value_problem(config)
    if problem:
        raise CpuQuantError(f"{cfg_path}: {problem}")
    return config


def _read_weight_map(index: Path) -> dict[str, str]:
    problem = file_problem(index)
    if problem:
        raise CpuQuantError(f"{index.name} {problem}")
    try:
        weight_map = parse_json(index.read_bytes(), index.name)["weight_map"]
    except (ValueError, KeyError, TypeError):  # JSONDecodeError, UnicodeDecodeError
        raise CpuQuantError(f"{index.name}: no valid weight_map") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise CpuQuantError(f"{index.name}: weight_map must map tensor names to file names")
    return weight_map


def _check_no_duplicates(headers: dict[Path, dict], shards: set[Path]) -> None:
    """Refuse a tensor stored in two of ``shards``: which copy a loader takes depends on how
    it reads them (by the index, or every tensor of every shard, the last read winning)."""
    seen: dict[str, Path] = {}
    for f in sorted(shards):
        for name in headers[f]:
            if name == "__metadata__":
                continue
            if name in seen:
                raise CpuQuantError(f"tensor {name} is in both {seen[name].name} and {f.name}; "
                                    "which copy is the model's is ambiguous: keep one")
            seen[name] = f


def open_checkpoint(path: str | Path) -> Checkpoint:
    root = Path(path)
    config = read_config(root)
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
    if index.exists() or index.is_symlink():
        for name, fname in _read_weight_map(index).items():
            f = root / fname
            if not _inside(root, f) or f not in headers:
                raise CpuQuantError(f"{index.name}: {name} points to missing or outside file {fname}")
            if name not in headers[f]:
                raise CpuQuantError(f"{index.name}: {name} is not in {fname}")
            files[name] = f
        _check_no_duplicates(headers, set(files.values()))
    else:
        _check_no_duplicates(headers, set(headers))
        for f, header in headers.items():
            for name in header:
                if name != "__metadata__":
                    files[name] = f
    return Checkpoint(root, config, files, headers)
