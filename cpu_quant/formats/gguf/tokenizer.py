"""The tokenizer's GGUF metadata: the vocabulary, the token types, and llama.cpp's name for the
pre-tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf

from ...core.errors import CpuQuantError


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
