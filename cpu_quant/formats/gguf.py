"""A llama.cpp GGUF file with Q4_0 blocks: the symmetric grid of ``gptq``, read by ``llama-cli -m``.

Every llama.cpp command that runs the file, whether cpu-quant runs it or prints it for a user,
comes from :func:`llama_cpp_command`, which turns llama.cpp's weight repacking off
(:data:`LLAMA_CPP_NO_REPACK`).

One file ``<model>-Q4_0.gguf`` (GGUF v3, little-endian, 32-byte tensor alignment, written with
the ``gguf`` package's ``GGUFWriter``). Per quantized linear ``<m>`` with out-features ``N``,
in-features ``K`` (a multiple of 32) and our group ``g`` (a multiple of 32, or ``K``):

=================  =======  ==================  ================================================
GGUF tensor        type     ggml shape ``ne``   content (row-major [N, K/32] blocks of 18 bytes)
=================  =======  ==================  ================================================
``blk.L.<name>``   Q4_0     [K, N]              block ``b`` of row ``n`` covers ``w[n, 32b ..
                                                32b+31]``: bytes 0-1 ``d`` (fp16, LE), bytes
                                                2-17 ``qs``: byte ``2 + j`` holds element ``j``
                                                in its low nibble and element ``j + 16`` in its
                                                high nibble (j = 0..15). ``q ∈ [0, 15]``.
=================  =======  ==================  ================================================

Dequantization (gguf-py ``quants.Q4_0.dequantize_blocks``, ggml ``dequantize_row_q4_0``):
``w[n, 32b + i] = (q[n, 32b + i] - 8) * d[n, b]``: the zero is the fixed 8, as ``gptq``'s.

* **Groups**: Q4_0's block is 32. Group 32 maps one to one; a group ``g = 32m`` writes its scale
  into each of its ``m`` blocks, so the weights are the same numbers (still 4.5 bits per
  weight: every block carries its own ``d``). :func:`unpack_q4_0` therefore reads group 32
  back; :func:`as_blocks_of_32` expands a :class:`GroupQuant` the same way for comparison.
* **Scales**: ours are bf16 values (``core/grid.py``), possibly negative; ``d`` is fp16.
  A bf16 value in fp16's range is exact in fp16 unless it is below ``2**-14`` with more
  significant bits than fp16's subnormals keep, or above 65504. Such a scale is refused
  (:class:`CpuQuantError` naming the tensor) rather than rounded: rounding would silently move
  the weights away from every other format of the same run.
* **Rows**: ``llama`` (Llama, Mistral) applies rope to interleaved pairs, HF to halves, so the
  converter permutes the rows of ``attn_q``/``attn_k`` within each head (``permute_rope_rows``).
  Whole rows move, blocks run along K, so the permutation is exact on the blocks.

Tensors not quantized, each as ``convert_hf_to_gguf.py`` names them:

==========================  =====  ==========================================================
tensor                      type   why
==========================  =====  ==========================================================
``token_embd``              Q8_0   see :data:`EMBEDDING_TYPE` (docs/gguf.md has the numbers)
``output`` (head kept)      Q8_0   same tensor as the embedding when tied, so the same type
norms (``*_norm``)          F32    what the converter writes; Gemma's stored as ``1 + w``
biases (Qwen2's q/k/v)      F32    what the converter writes
a linear kept float         BF16   exact: the plan keeps one float only when K % 32 != 0
==========================  =====  ==========================================================

Metadata: ``general.architecture`` and ``{arch}.*`` hyperparameters, ``general.file_type = 2``
(MOSTLY_Q4_0), the tokenizer (``tokenizer.ggml.model = gpt2``, tokens, token types, merges,
special ids, ``add_bos_token``, the pre-tokenizer name from :data:`PRE_TOKENIZERS`) and the chat
template, and ``cpu_quant.*`` provenance (group, head_quantized).

While a run is going, each ``end_layer`` writes ``.gguf-parts/part-XXXXX.safetensors``: the
layer's Q4_0 blocks as uint8 [N, K/32 * 18] under their Hugging Face names and its float tensors
as given (bf16). ``finish`` maps names, permutes, converts and streams everything into
``<model>-Q4_0.gguf.partial``, renames it into place and deletes the parts.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from ..core.errors import CpuQuantError
from ..core.findings import Finding, error, info
from ..core.grid import GroupQuant
from ..core.io.safetensors_writer import write_safetensors
from .base import Format, Limits
from .sink import ArtifactInfo, Sink

# On a CPU with AMX, llama.cpp (the vendored 0.3.36 build and upstream alike; llama.cpp #20824,
# "segfault in ggml_backend_amx_mul_mat") repacks Q4_0 weights into its AMX buffer type and then
# crashes with SIGSEGV in the first decode (llama-perplexity --kl-divergence, llama-imatrix,
# llama-cli). With repacking off the weights stay in the file's layout and run everywhere.
LLAMA_CPP_NO_REPACK = "--no-repack"


def llama_cpp_command(tool: str | Path, model: str | Path, *args: str | Path) -> list[str]:
    """The argv of a llama.cpp tool that runs ``model`` (``llama-cli``, ``llama-server``,
    ``llama-perplexity``, ``llama-imatrix``: the tools parsing llama.cpp's common options):
    ``tool -m MODEL --no-repack ARGS``. ``llama-quantize`` only rewrites a file, never runs
    it, and takes no such option."""
    return [str(tool), "-m", str(model), LLAMA_CPP_NO_REPACK, *map(str, args)]


BLOCK = 32  # Q4_0 elements per block
BLOCK_BYTES = 18  # fp16 d + 16 bytes of nibbles
FP16_MAX = 65504.0
PARTS_DIR = ".gguf-parts"
FILE_SUFFIX = "-Q4_0.gguf"
# The type of token_embd (and of the head when it is not quantized). Measured in llama.cpp on the
# demo model (tied head, held-out text, gguf-fidelity-20261202T151917Z/151943Z.json): F16 instead
# of Q8_0 takes KL from 0.0744 to 0.0723 nats for +26% file size (8.5 against 16 bits per weight
# on the model's largest tensor); llama.cpp's own Q4_0 of the model picks Q8_0 as well.
EMBEDDING_TYPE = gguf.GGMLQuantizationType.Q8_0
FLOAT_LINEAR_TYPE = gguf.GGMLQuantizationType.BF16
Q4_0 = gguf.GGMLQuantizationType.Q4_0
F32 = gguf.GGMLQuantizationType.F32
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# -- the Q4_0 blocks ---------------------------------------------------------------------------
def fp16_scales(scales: torch.Tensor, module: str) -> torch.Tensor:
    """float32 (bf16-valued) scales -> float16, exactly, or a one-line error naming ``module``."""
    half = scales.to(torch.float16)
    bad = ~torch.isfinite(half) | (half.to(torch.float32) != scales)
    if bool(bad.any()):
        value = float(scales[bad].flatten()[0])
        raise CpuQuantError(f"{module}: {int(bad.sum())} scale(s) not exact in fp16 (e.g. {value:.6g}); "
                            f"GGUF Q4_0 stores fp16 scales, exact for |d| in [6.1e-05, 65504]")
    return half


def as_blocks_of_32(gq: GroupQuant) -> GroupQuant:
    """``gq`` on Q4_0's blocks: the same codes, each group's scale repeated in its blocks."""
    if gq.zeros is not None:
        raise CpuQuantError("Q4_0 holds only the symmetric grid (zeros given)")
    n, k = gq.shape
    if k % BLOCK or gq.group_size % BLOCK:
        raise CpuQuantError(f"Q4_0 needs in-features and group multiples of {BLOCK} "
                            f"(K={k}, group {gq.group_size})")
    scales = gq.scales.repeat_interleave(gq.group_size // BLOCK, dim=1)
    return GroupQuant(gq.codes, scales.contiguous(), None, BLOCK)


def pack_q4_0(gq: GroupQuant, module: str = "module") -> torch.Tensor:
    """A symmetric :class:`GroupQuant` [N, K] -> Q4_0 blocks, uint8 [N, K/32 * 18]."""
    b = as_blocks_of_32(gq)
    n, k = b.shape
    d = fp16_scales(b.scales, module).contiguous().view(torch.uint8).view(n, k // BLOCK, 2)
    q = b.codes.to(torch.uint8).view(n, k // BLOCK, BLOCK)
    qs = q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return torch.cat([d, qs], dim=-1).reshape(n, k // BLOCK * BLOCK_BYTES).contiguous()


def unpack_q4_0(blocks: torch.Tensor) -> GroupQuant:
    """Q4_0 blocks uint8 [N, K/32 * 18] -> a group-32 :class:`GroupQuant` (codes and scales)."""
    n, nbytes = blocks.shape
    if nbytes % BLOCK_BYTES:
        raise CpuQuantError(f"Q4_0 row of {nbytes} bytes is not whole blocks of {BLOCK_BYTES}")
    raw = blocks.reshape(n, nbytes // BLOCK_BYTES, BLOCK_BYTES)
    d = raw[..., :2].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)
    qs = raw[..., 2:]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, -1)
    return GroupQuant(codes.contiguous(), d.contiguous(), None, BLOCK)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks -> float32 [N, K]: ``(q - 8) * d`` (the reference gguf-py is held to)."""
    return unpack_q4_0(blocks).dequantize()


def permute_rope_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's half-split rope rows -> llama.cpp's interleaved order, per head (any row payload)."""
    n = rows.shape[0]
    return rows.reshape(n_head, 2, n // n_head // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def unpermute_rope_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`permute_rope_rows`."""
    n = rows.shape[0]
    return rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


# -- architectures -------------------------------------------------------------------------------
def _rope_theta(cfg: dict, kind: str = "full_attention") -> float | None:
    if cfg.get("rope_theta") is not None and kind == "full_attention":
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    if kind in params:
        params = params[kind]
    elif kind != "full_attention":
        return None
    theta = params.get("rope_theta")
    return None if theta is None else float(theta)


def _gemma2_keys(w: gguf.GGUFWriter, cfg: dict) -> None:
    if cfg.get("attn_logit_softcapping") is not None:
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
    if cfg.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("sliding_window") is not None:
        w.add_sliding_window(int(cfg["sliding_window"]))


def _gemma3_keys(w: gguf.GGUFWriter, cfg: dict) -> None:
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("sliding_window_pattern") != 1 and cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
    if (swa := _rope_theta(cfg, "sliding_attention")) is not None:
        w.add_rope_freq_base_swa(swa)
    rope = (cfg.get("rope_parameters") or {}).get("full_attention") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "linear" and rope.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))


def _llama_keys(w: gguf.GGUFWriter, cfg: dict) -> None:
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_rope_dimension_count(_head_dim(cfg))


@dataclass(frozen=True)
class ArchSpec:
    """How one Hugging Face architecture becomes a llama.cpp one (convert_hf_to_gguf.py's class)."""

    arch: gguf.MODEL_ARCH
    rope_permute: bool  # llama's interleaved ("NORM") rope: Q/K rows permuted per head
    norm_shift: float  # Gemma's RMSNorm multiplies by (1 + w): stored as 1 + w
    head_tensor: bool  # the arch has an ``output`` tensor (Gemma 2 always reads token_embd)
    extra_keys: Callable[[gguf.GGUFWriter, dict], None] | None = None

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


_LLAMA = ArchSpec(gguf.MODEL_ARCH.LLAMA, True, 0.0, True, _llama_keys)
# architectures[0] of config.json -> spec; evidence: the converter's class for each
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": _LLAMA,  # LlamaModel
    "MistralForCausalLM": _LLAMA,  # registered under LlamaModel ("llama")
    "Qwen2ForCausalLM": ArchSpec(gguf.MODEL_ARCH.QWEN2, False, 0.0, True),  # Qwen2Model, NEOX rope
    "Qwen3ForCausalLM": ArchSpec(gguf.MODEL_ARCH.QWEN3, False, 0.0, True),  # Qwen3Model
    "Gemma2ForCausalLM": ArchSpec(gguf.MODEL_ARCH.GEMMA2, False, 1.0, False, _gemma2_keys),
    "Gemma3ForCausalLM": ArchSpec(gguf.MODEL_ARCH.GEMMA3, False, 1.0, True, _gemma3_keys),
}


def arch_spec(cfg: dict) -> ArchSpec:
    """The spec of ``cfg``'s architecture, or a one-line error naming the ones supported."""
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else cfg.get("model_type", "?")
    spec = ARCHITECTURES.get(name)
    if spec is None:
        raise CpuQuantError(f"gguf: architecture {name} is not supported (supported: "
                            f"{', '.join(ARCHITECTURES)})")
    return spec


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _write_hyperparameters(w: gguf.GGUFWriter, spec: ArchSpec, cfg: dict) -> None:
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if (theta := _rope_theta(cfg)) is not None:
        w.add_rope_freq_base(theta)
    if cfg.get("head_dim") is not None:  # as the converter: whenever config.json states it
        w.add_key_length(int(cfg["head_dim"]))
        w.add_value_length(int(cfg["head_dim"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    if spec.extra_keys is not None:
        spec.extra_keys(w, cfg)


# -- the tokenizer -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreTokenizerRule:
    """A tokenizer.json whose pre-tokenizer regexes are ``regexes`` (and, if given, whose
    vocabulary has ``token`` at ``token_id``) is llama.cpp's pre-tokenizer ``name``."""

    name: str
    regexes: tuple[str, ...]
    evidence: str
    token: str | None = None
    token_id: int | None = None


_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_RE = _QWEN2_RE.replace(r"\p{N}|", r"\p{N}{1,3}|")
_BYTE_LEVEL = "<byte-level>"  # ByteLevel(use_regex=True): GPT-2's regex, implied
PRE_TOKENIZERS: tuple[PreTokenizerRule, ...] = (
    PreTokenizerRule("smollm", (_BYTE_LEVEL,), "SmolLM/SmolLM2 (converter hash of "
                     "HuggingFaceTB/SmolLM-135M); the demo model's GGUF says smollm",
                     token="<|im_start|>", token_id=1),
    PreTokenizerRule("qwen2", (_QWEN2_RE, "<byte-level-noregex>"),
                     "Qwen2/Qwen3 tokenizer.json Split regex (llama-vocab.cpp QWEN2)"),
    PreTokenizerRule("llama-bpe", (_LLAMA3_RE, "<byte-level-noregex>"),
                     "Llama 3 tokenizer.json Split regex (llama-vocab.cpp LLAMA3)"),
)


def _pre_tokenizer_regexes(node) -> tuple[str, ...]:
    if not isinstance(node, dict):
        return ()
    kind = node.get("type")
    if kind == "Sequence":
        return tuple(r for p in node.get("pretokenizers", []) for r in _pre_tokenizer_regexes(p))
    if kind == "Split":
        return (node.get("pattern", {}).get("Regex", ""),)
    if kind == "ByteLevel":
        return (_BYTE_LEVEL if node.get("use_regex", True) else "<byte-level-noregex>",)
    if kind == "Digits":
        return ()  # SmolLM2's original splits digits individually; llama.cpp's smollm does too
    return (f"<{kind}>",)


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a BPE tokenizer.json, from :data:`PRE_TOKENIZERS`."""
    regexes = _pre_tokenizer_regexes(tokenizer_json.get("pre_tokenizer"))
    vocab = tokenizer_json["model"].get("vocab", {})
    for rule in PRE_TOKENIZERS:
        if regexes == rule.regexes and (rule.token is None or vocab.get(rule.token) == rule.token_id):
            return rule.name
    raise CpuQuantError(f"gguf: tokenizer pre-tokenizer {regexes or 'none'} is not one llama.cpp is "
                        f"known here to split the same way ({', '.join(r.name for r in PRE_TOKENIZERS)})"
                        "; pass GGUFFormat(pre_tokenizer=NAME)")


def _looks_special(token: str) -> bool:
    # the converter's does_token_look_special: added tokens some models leave unmarked
    return token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>"))


def vocab_tokens(source: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their ``gguf.TokenType``, ids the tokenizer lacks as ``[PADi]`` UNUSED."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            kind = gguf.TokenType.CONTROL if added[i].special or _looks_special(token) \
                else gguf.TokenType.USER_DEFINED
        else:
            kind = gguf.TokenType.NORMAL
        tokens.append(token)
        types.append(int(kind))
    return tokens, types


def _write_tokenizer(w: gguf.GGUFWriter, source: Path, cfg: dict, pre: str | None) -> None:
    path = source / "tokenizer.json"
    if not path.is_file():
        raise CpuQuantError(f"gguf: {source} has no tokenizer.json (a BPE tokenizer is needed)")
    tj = json.loads(path.read_text(encoding="utf-8"))
    if tj.get("model", {}).get("type") != "BPE" or not tj["model"].get("merges"):
        raise CpuQuantError("gguf: only BPE tokenizers (tokenizer.ggml.model gpt2) are written; "
                            f"{path} is {tj.get('model', {}).get('type')}")
    tokens, types = vocab_tokens(source, int(cfg["vocab_size"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or pre_tokenizer_name(tj))
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(source, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


# -- the sink --------------------------------------------------------------------------------
def _part_name(index: int) -> str:
    return f"part-{index:05d}.safetensors"


@dataclass(frozen=True)
class _Entry:
    """One tensor of the final file: where its part data is and how it is converted."""

    gguf_name: str
    hf_name: str
    part: Path
    kind: str  # q4_0 | norm | bias | embedding | float_linear


class GGUFSink(Sink):
    def __init__(self, fmt: GGUFFormat, directory: Path, n_layers: int, resume_state: dict | None):
        self.fmt = fmt
        self.directory = Path(directory)
        self.parts_dir = self.directory / PARTS_DIR
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        self.n_layers = n_layers
        state = resume_state or {}
        self.parts: list[str] = list(state.get("parts", []))
        self.kinds: dict[str, str] = dict(state.get("kinds", {}))
        self._pending: dict[str, torch.Tensor] = {}

    def add_module(self, module: str, gq: GroupQuant) -> int:
        blocks = pack_q4_0(gq, module)
        self._pending[module] = blocks
        self.kinds[module] = "q4_0"
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
        cfg = info.source_config
        spec = arch_spec(cfg)
        target = self.directory / gguf_file_name(info.source, info.source_config)
        entries = self._entries(spec, cfg)
        tmp = target.with_name(target.name + ".partial")
        tmp.unlink(missing_ok=True)
        try:
            _write_file(tmp, spec, cfg, info, entries, self.fmt.pre_tokenizer)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        report = target.with_name(target.name[: -len(".gguf")] + ".quantization_report.json")
        rtmp = report.with_name(report.name + ".tmp")
        rtmp.write_text(json.dumps(info.report, indent=2, sort_keys=True))
        os.replace(rtmp, report)
        shutil.rmtree(self.parts_dir, ignore_errors=True)

    def _entries(self, spec: ArchSpec, cfg: dict) -> list[_Entry]:
        names = gguf.get_tensor_name_map(spec.arch, int(cfg["num_hidden_layers"]))
        tied = bool(cfg.get("tie_word_embeddings", False))
        entries = []
        for part in self.parts:
            path = self.parts_dir / part
            with safe_open(path, "pt") as f:
                keys = sorted(f.keys())
            for hf in keys:
                kind = self.kinds.get(hf) or _float_kind(hf)
                if hf == "lm_head.weight" and kind != "q4_0" and (tied or not spec.head_tensor):
                    continue  # llama.cpp reads token_embd as the head
                if hf == "lm_head" and not spec.head_tensor:
                    raise CpuQuantError(f"gguf: {spec.name} has no output tensor; do not quantize its head")
                lookup = hf if kind != "q4_0" else hf + ".weight"
                gname = names.get_name(lookup, try_suffixes=(".weight", ".bias"))
                if gname is None:
                    raise CpuQuantError(f"gguf: {hf} has no {spec.name} tensor name in llama.cpp")
                entries.append(_Entry(gname, hf, path, kind))
        return sorted(entries, key=lambda e: _tensor_order(e.gguf_name))


def _float_kind(name: str) -> str:
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


def gguf_file_name(source: Path, source_config: dict | None = None) -> str:
    """``<model>-Q4_0.gguf``: the source directory's name without a trailing ``-bf16``."""
    stem = Path(source).name
    stem = stem[:-5] if stem.endswith("-bf16") else stem
    return stem + FILE_SUFFIX


def _heads_of(hf_name: str, cfg: dict) -> int:
    if ".q_proj" in hf_name:
        return int(cfg["num_attention_heads"])
    return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])


def _target_type(entry: _Entry) -> gguf.GGMLQuantizationType:
    return {"q4_0": Q4_0, "norm": F32, "bias": F32, "embedding": EMBEDDING_TYPE,
            "float_linear": FLOAT_LINEAR_TYPE}[entry.kind]


def _tensor_info(entry: _Entry, shape: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype, int]:
    """(numpy shape as stored, numpy dtype as stored, bytes) of one entry, without its data."""
    qtype = _target_type(entry)
    if qtype == F32:
        return shape, np.dtype(np.float32), 4 * math.prod(shape)
    if qtype == Q4_0:  # the part already holds the block bytes
        return shape, np.dtype(np.uint8), math.prod(shape)
    byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
    return byte_shape, np.dtype(np.uint8), math.prod(byte_shape)


def _convert(entry: _Entry, tensor: torch.Tensor, spec: ArchSpec, cfg: dict) -> np.ndarray:
    """One part tensor -> its data as written (rows permuted, norms shifted, types converted)."""
    if spec.rope_permute and re.search(r"\.(q|k)_proj(\.weight|\.bias)?$", entry.hf_name):
        tensor = permute_rope_rows(tensor, _heads_of(entry.hf_name, cfg))
    qtype = _target_type(entry)
    if qtype == Q4_0:
        return tensor.contiguous().numpy()
    t = tensor.to(torch.float32)
    if entry.kind == "norm":
        t = t + spec.norm_shift  # in float32, as HF's Gemma RMSNorm computes 1 + w
    if qtype == F32:
        return t.contiguous().numpy()
    return gguf.quants.quantize(t.contiguous().numpy(), qtype)


def _write_file(path: Path, spec: ArchSpec, cfg: dict, art: ArtifactInfo, entries: list[_Entry],
                pre: str | None) -> None:
    w = gguf.GGUFWriter(path, spec.name)
    w.add_name(gguf_file_name(art.source)[: -len(FILE_SUFFIX)])
    _write_hyperparameters(w, spec, cfg)
    _write_tokenizer(w, Path(art.source), cfg, pre)
    w.add_uint32("cpu_quant.group_size", int(art.default_group))
    w.add_bool("cpu_quant.head_quantized", bool(art.head_quantized))
    for e in entries:  # shapes and byte counts first: the header precedes the data
        with safe_open(e.part, "pt") as f:
            shape = tuple(f.get_slice(e.hf_name).get_shape())
        np_shape, dtype, nbytes = _tensor_info(e, shape)
        w.add_tensor_info(e.gguf_name, np_shape, dtype, nbytes, raw_dtype=_target_type(e))
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for e in entries:
        with safe_open(e.part, "pt") as f:
            tensor = f.get_tensor(e.hf_name)
        w.write_tensor_data(_convert(e, tensor, spec, cfg))
    assert w.fout is not None
    for f in w.fout:
        f.flush()
        os.fsync(f.fileno())
    w.close()


# -- reading back: unpack, verify, inspect ---------------------------------------------------
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
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise CpuQuantError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0][:200]})") from None


def _undo_rows(spec: ArchSpec, cfg: dict, module: str, rows: torch.Tensor) -> torch.Tensor:
    if spec.rope_permute and module.endswith(("q_proj", "k_proj")):
        heads = cfg["num_attention_heads"] if module.endswith("q_proj") else cfg["num_key_value_heads"]
        return unpermute_rope_rows(rows, int(heads))
    return rows


def unpack(path: Path) -> dict[str, GroupQuant]:
    """Every Q4_0 linear of a GGUF file, by HF module name, as group-32 :class:`GroupQuant`
    in Hugging Face row order (llama's rope permutation undone). Compare with the quantizer's
    result through :func:`as_blocks_of_32` (a group of 128 reads back as four blocks of 32)."""
    reader = _open(Path(path))
    spec, cfg = _reader_config(reader)
    modules = _hf_module_names(spec, cfg["num_hidden_layers"])
    out = {}
    for t in reader.tensors:
        if t.tensor_type != Q4_0 or t.name not in modules:
            continue
        blocks = torch.from_numpy(np.array(t.data)).reshape(int(t.shape[1]), -1)
        module = modules[t.name]
        out[module] = unpack_q4_0(_undo_rows(spec, cfg, module, blocks))
    return out


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
    if spec.arch in (gguf.MODEL_ARCH.QWEN3, gguf.MODEL_ARCH.GEMMA3):
        per.update({"attn_q_norm": (hd,), "attn_k_norm": (hd,)})
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
            "vocab_size": len(tokens) if tokens is not None else get("vocab_size")}


def verify(path: Path, source_config: dict | None = None) -> list[Finding]:
    """Structural checks of a GGUF file; errors say why it is refused.

    Magic and version; the tensors llama.cpp needs for the architecture, each with the right
    shape (against ``source_config`` when given, else the file's own hyperparameters) and type
    (Q4_0 for linears, F32 for norms); every Q4_0 ``d`` finite; the metadata keys present; and
    that the data ends where the file does (a truncated file is refused).
    """
    path = Path(path)
    found = list(_check_file_size(path))
    if found:
        return found
    try:
        reader = gguf.GGUFReader(path)
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
        if name.endswith("norm.weight") and t.tensor_type != F32:
            found.append(error("gguf-type", name, f"{t.tensor_type.name}, expected F32"))
        if t.tensor_type == Q4_0:
            d = np.ascontiguousarray(t.data).reshape(-1, BLOCK_BYTES)[:, :2].copy().view(np.float16)
            if not np.isfinite(d).all():
                found.append(error("gguf-scale", name, f"{int((~np.isfinite(d)).sum())} non-finite d"))
    for t in reader.tensors:
        end = max(end, int(t.data_offset) + int(t.n_bytes))
    if end > path.stat().st_size:
        found.append(error("gguf-truncated", path.name, f"data ends at byte {end}, file has "
                                                        f"{path.stat().st_size}"))
    if not any(f.severity == "error" for f in found):
        found.append(info("gguf", path.name, f"{arch}: {len(tensors)} tensors, "
                                             f"{sum(t.tensor_type == Q4_0 for t in reader.tensors)} Q4_0"))
    return found


def inspect(path: Path) -> dict:
    """A summary: architecture, tensor count, types histogram, bits per weight, size."""
    path = Path(path)
    reader = _open(path)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    q = [t for t in reader.tensors if t.tensor_type == Q4_0]
    q_weights = sum(int(t.n_elements) for t in q)
    all_weights = sum(int(t.n_elements) for t in reader.tensors)
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    return {"architecture": _field_value(reader, "general.architecture"),
            "tensors": len(reader.tensors), "types": dict(sorted(types.items())),
            "q4_0_bits_per_weight": (8 * sum(int(t.n_bytes) for t in q) / q_weights) if q_weights else None,
            "bits_per_weight": 8 * tensor_bytes / all_weights if all_weights else math.nan,
            "weights": all_weights, "tensor_bytes": tensor_bytes, "file_bytes": path.stat().st_size,
            "pre_tokenizer": _field_value(reader, "tokenizer.ggml.pre")}


def gguf_file_in(path: Path) -> Path | None:
    """``path`` itself when it is a ``.gguf`` file; the one ``.gguf`` file of a directory; None."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        return files[0] if len(files) == 1 else None
    return None


# -- the format ------------------------------------------------------------------------------
class GGUFFormat(Format, name="gguf"):
    """llama.cpp's GGUF with Q4_0 linears (see the module docstring for the layout)."""

    limits = Limits(groups=(128, 64, 32), row_group=True, k_multiple=BLOCK, n_multiple=1,
                    stores_zeros=False, kernel="llama.cpp Q4_0")

    def __init__(self, pre_tokenizer: str | None = None) -> None:
        self.pre_tokenizer = pre_tokenizer

    def refuse_source(self, source_config: dict) -> str | None:
        """Why a model with this config.json cannot be written as GGUF (checked before work)."""
        try:
            arch_spec(source_config)
        except CpuQuantError as e:
            return str(e)
        return None

    def open_sink(self, directory: Path, n_layers: int, resume_state: dict | None) -> GGUFSink:
        return GGUFSink(self, directory, n_layers, resume_state)

    def owns(self, path: Path) -> bool:
        return gguf_file_in(Path(path)) is not None

    def verify_artifact(self, path: Path) -> tuple[list[Finding], int]:
        file = gguf_file_in(Path(path))
        quantized = sum(t.tensor_type == Q4_0 for t in _open(file).tensors)
        return verify(file), quantized

    def inspect_artifact(self, path: Path) -> dict:
        return inspect(gguf_file_in(Path(path)))

    def dequantized_modules(self, path: Path):
        for module, gq in unpack(gguf_file_in(Path(path))).items():
            yield module, gq.dequantize()

    pack = staticmethod(pack_q4_0)
    unpack_blocks = staticmethod(unpack_q4_0)
    unpack = staticmethod(unpack)
    verify = staticmethod(verify)
    inspect = staticmethod(inspect)

