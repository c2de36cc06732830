"""The per-tensor type mix of llama.cpp's file types: which ggml type ``llama-quantize`` gives
each tensor of a model for ``Q4_K_M``, ``Q4_K_S`` and ``IQ4_NL``, so that our file of that
type holds the same types as llama.cpp's own.

From ``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp`` (ggml-org/llama.cpp at
007dbbf, read for the architectures this package writes: no experts, not Falcon, not a 70B),
kept as data (:data:`RULES`), first matching row per tensor class wins, as the C++ chain:

* the output head, and the token embedding when the head is tied to it: ``Q8_0`` when its
  rows are not whole blocks of the file type's default type, else ``Q6_K``;
* the token embedding of an untied model, and every tensor no row names: the default type;
* ``attn_v`` and ``ffn_down``: the rows of :data:`RULES` (``use_more_bits``: the first and
  last eighth of the layers and every third one between);
* then the shape fallback (``tensor_type_fallback``): a type whose block does not divide the
  rows (K) is replaced: ``Q4_K`` by ``Q5_0``, ``Q5_K`` by ``Q5_1``, ``Q6_K`` by ``Q8_0``.

``calibrated`` stands for llama.cpp's ``has_imatrix``: our quantization is calibrated unless
the run is data-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf

from ...core.errors import CpuQuantError

T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class TensorFacts:
    """What llama.cpp's choice depends on, for one tensor."""

    name: str  # GGUF tensor name, e.g. blk.3.attn_v.weight
    columns: int  # ne[0]: the in-features, along which blocks run
    layer: int  # the layer index, -1 outside the layers
    n_layers: int
    n_gqa: int  # attention heads per KV head
    tied: bool  # the output head is the token embedding
    calibrated: bool


@dataclass(frozen=True)
class FileType:
    """One of llama.cpp's file types: its name, ``general.file_type`` and default type."""

    name: str  # as llama-quantize spells it: Q4_K_M
    llama_file_type: gguf.LlamaFileType
    default: gguf.GGMLQuantizationType


Q4_K_M = FileType("Q4_K_M", gguf.LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K)
Q4_K_S = FileType("Q4_K_S", gguf.LlamaFileType.MOSTLY_Q4_K_S, T.Q4_K)
IQ4_NL = FileType("IQ4_NL", gguf.LlamaFileType.MOSTLY_IQ4_NL, T.IQ4_NL)


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every third
    layer between (C++ integer division)."""
    e = n_layers // 8
    return layer < e or layer >= 7 * n_layers // 8 or (layer - e) % 3 == 2


@dataclass(frozen=True)
class Rule:
    """One row: for tensors of ``role`` in a file of ``file_type``, when ``when`` holds, the
    type ``qtype``."""

    file_type: str
    role: str  # attn_v | ffn_down
    when: Callable[[TensorFacts], bool]
    qtype: gguf.GGMLQuantizationType
    condition: str  # the C++ condition, for the docs


RULES: tuple[Rule, ...] = (
    Rule("IQ4_NL", "attn_v", lambda t: t.n_gqa >= 4, T.Q5_K, "n_gqa() >= 4"),
    Rule("Q4_K_M", "attn_v", lambda t: use_more_bits(t.layer, t.n_layers), T.Q6_K,
         "use_more_bits(i_attention_wv, n_attention_wv)"),
    Rule("Q4_K_S", "attn_v", lambda t: t.layer < 4, T.Q5_K, "i_attention_wv < 4"),
    Rule("Q4_K_M", "ffn_down", lambda t: use_more_bits(t.layer, t.n_layers), T.Q6_K,
         "use_more_bits(i_layer, n_layer)"),
    Rule("IQ4_NL", "ffn_down", lambda t: t.layer < t.n_layers // 8 and not t.calibrated, T.Q5_K,
         "i_layer < n_layer/8 && !has_imatrix"),
    Rule("Q4_K_S", "ffn_down", lambda t: t.layer < t.n_layers // 8, T.Q5_K, "i_layer < n_layer/8"),
)

# tensor_type_fallback: a type whose block does not divide the rows, and its replacement
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _role(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for role in ("attn_v", "ffn_down"):
        if f".{role}." in name:
            return role
    return "other"


def _block(qtype: gguf.GGMLQuantizationType) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def chosen_type(ftype: FileType, t: TensorFacts) -> gguf.GGMLQuantizationType:
    """The type ``llama-quantize`` gives the tensor ``t`` for ``ftype``, fallback included."""
    role = _role(t.name)
    qtype = ftype.default
    if role == "output" or (role == "token_embd" and t.tied):
        qtype = T.Q8_0 if t.columns % _block(ftype.default) else T.Q6_K
    else:
        for rule in RULES:
            if rule.file_type == ftype.name and rule.role == role and rule.when(t):
                qtype = rule.qtype
                break
    if t.columns % _block(qtype):
        qtype = FALLBACK.get(qtype, qtype)
    if t.columns % _block(qtype):
        raise CpuQuantError(f"{t.name}: {t.columns} columns are not whole blocks of "
                            f"{_block(qtype)} ({qtype.name})")
    return qtype
