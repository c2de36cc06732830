"""Tiny random decoder-only models of every architecture cpu-quant supports (dense, and the
mixture-of-experts families of :data:`MOE_ARCHS`), with the demo
tokenizer: the unit tests' models (:data:`UNIT`) and the larger ones of the ``fidelity_archs``
benchmark (``benchmarks/suites/fidelity_archs.py``), from one definition.

A model is a transformers config class, the few keys its architecture needs
(:data:`TINY_ARCHS`), a :class:`TinyShape` and a seed; it is saved as bf16 safetensors with the
demo model's tokenizer files, so the same seed and shape always give the same weights.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEMO_VOCAB = 49152  # the demo tokenizer's vocabulary
DEMO_BYTES_END = 252  # its 17 special tokens, then its byte alphabet (235 of the 256 bytes)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class TinyShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    # None: the config class' default (the architecture's own choice of tied or untied head)
    tied: bool | None = True
    # None: the config class' default initializer_range (0.02 for all of these)
    init_std: float | None = None
    # mixture-of-experts: routed experts per layer (0: a dense MLP), experts per token, and
    # each expert's intermediate size
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# the unit tests' models: small enough to quantize in a second
UNIT = TinyShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
# Qwen3-MoE at Qwen3-30B-A3B's ratios (hidden 2048, 128 experts of intermediate 768, 8 per
# token, 32 query heads of 128 over 4 KV heads, intermediate_size 6144, untied head): 1/16 of
# the experts per token, expert intermediate 3/8 of hidden, 8 query heads per KV head, query
# width twice the hidden size, no shared expert. Every linear's in-features a multiple of 32
# (Q4_0's block).
QWEN3_MOE = TinyShape(hidden=256, intermediate=768, layers=2, heads=8, kv_heads=1, tied=False,
                      experts=32, experts_per_token=2, expert_intermediate=96)


def _head_dim(shape: TinyShape) -> dict:
    return {"head_dim": shape.head_dim}


def _gemma(shape: TinyShape) -> dict:
    return {"head_dim": shape.head_dim, "query_pre_attn_scalar": shape.head_dim,
            "sliding_window": 64}


def _qwen3_moe(shape: TinyShape) -> dict:
    # head_dim twice hidden / heads, as Qwen3-30B-A3B's 128 x 32 heads over hidden 2048; every
    # layer sparse and the top-k weights renormalised, as the family's checkpoints (and
    # llama.cpp's qwen3moe graph, which always renormalises)
    return {"head_dim": 2 * shape.head_dim, "num_experts": shape.experts,
            "num_experts_per_tok": shape.experts_per_token,
            "moe_intermediate_size": shape.expert_intermediate, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


# architecture -> (transformers config class, the keys it needs beyond the shape)
TINY_ARCHS: dict[str, tuple[str, Callable[[TinyShape], dict]]] = {
    "llama": ("LlamaConfig", lambda s: {}),
    "mistral": ("MistralConfig", lambda s: {"sliding_window": None}),
    "qwen2": ("Qwen2Config", lambda s: {}),
    "qwen3": ("Qwen3Config", _head_dim),
    "gemma2": ("Gemma2Config", _gemma),
    "gemma3": ("Gemma3TextConfig", _gemma),
    "phi3": ("Phi3Config", lambda s: {"pad_token_id": 0}),
}
# the mixture-of-experts architectures (apart: not every format takes them), and the shape
# each is built with by default
MOE_ARCHS: dict[str, tuple[str, Callable[[TinyShape], dict]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", _qwen3_moe),
}
MOE_SHAPES = {"qwen3_moe": QWEN3_MOE}


def tiny_config(arch: str, shape: TinyShape = UNIT, vocab: int = DEMO_VOCAB):
    """The transformers config of a tiny ``arch`` model of ``shape``."""
    import transformers

    cls_name, extra = {**TINY_ARCHS, **MOE_ARCHS}[arch]
    kwargs = dict(vocab_size=vocab, hidden_size=shape.hidden,
                  intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  max_position_embeddings=1024)
    if shape.tied is not None:
        kwargs["tie_word_embeddings"] = shape.tied
    if shape.init_std is not None:
        kwargs["initializer_range"] = shape.init_std
    kwargs.update(extra(shape))
    return getattr(transformers, cls_name)(**kwargs)


def copy_tokenizer(demo_src: Path, dst: Path, vocab: int = DEMO_VOCAB) -> None:
    """The demo tokenizer's files; for a model of fewer than :data:`DEMO_VOCAB` tokens, its
    first ``vocab`` tokens (:func:`truncated_bpe`), so that no token id falls outside the
    model's embedding."""
    for name in TOKENIZER_FILES:
        if not (demo_src / name).exists():
            continue
        if name == "tokenizer.json" and vocab < DEMO_VOCAB:
            tj = json.loads((demo_src / name).read_text(encoding="utf-8"))
            (dst / name).write_text(json.dumps(truncated_bpe(tj, vocab), ensure_ascii=False),
                                    encoding="utf-8")
        else:
            shutil.copy(demo_src / name, dst / name)


def truncated_bpe(tokenizer_json: dict, vocab: int) -> dict:
    """A byte-level BPE tokenizer.json cut to its tokens of id below ``vocab``: the merges whose
    two parts and result all remain, in their order, and the added tokens that remain: a
    tokenizer of the same pre-tokenizer that still tokenizes any text the demo's does (its
    first :data:`DEMO_BYTES_END` ids are its special tokens and its byte alphabet)."""
    if vocab < DEMO_BYTES_END:
        raise ValueError(f"a vocabulary of {vocab} tokens lacks the demo tokenizer's byte alphabet "
                         f"(ids below {DEMO_BYTES_END})")
    model = tokenizer_json["model"]
    kept = {t: i for t, i in model["vocab"].items() if i < vocab}
    merges = [m for m in model["merges"]
              if all(part in kept for part in (*_merge_parts(m), "".join(_merge_parts(m))))]
    return {**tokenizer_json,
            "added_tokens": [t for t in tokenizer_json.get("added_tokens", []) if t["id"] < vocab],
            "model": {**model, "vocab": kept, "merges": merges}}


def _merge_parts(merge) -> tuple[str, str]:
    return tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ", 1))


def make_tiny_model(arch: str, dst: Path, demo_src: Path, seed: int = 0, vocab: int = DEMO_VOCAB,
                    shape: TinyShape | None = None) -> Path:
    """A tiny random ``arch`` model of ``shape`` (weights from ``torch.manual_seed(seed)``;
    default :data:`UNIT`, or the family's shape of :data:`MOE_SHAPES`), saved to ``dst`` as
    bf16 safetensors (a mixture-of-experts model's experts one tensor per expert projection, as
    the family's checkpoints) with the demo tokenizer (its first ``vocab`` tokens when
    ``vocab`` is smaller than the demo's)."""
    import torch
    import transformers

    config = tiny_config(arch, shape or MOE_SHAPES.get(arch, UNIT), vocab)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    copy_tokenizer(demo_src, dst, vocab)
    return dst


# -- vision-language ---------------------------------------------------------------------------
# Idefics3 (SmolVLM): a SigLIP-style vision tower, a pixel-shuffle projector and a Llama decoder.
# The tiny one's heads are 32 wide (vLLM's CPU attention takes no narrower head), its image
# 56 pixels square: 4x4 patches of 14, shuffled by 2 into 4 image tokens.
VLM_SHAPE = TinyShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, tied=False)
VLM_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 56, "patch_size": 14}
VLM_SCALE = 2  # the projector's pixel shuffle
VLM_VOCAB = 49216  # the demo vocabulary and the image tokens, padded to a multiple of 64
# the Idefics3 processor's tokens, added to the demo tokenizer in this order
VLM_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")


def vlm_image_tokens() -> int:
    """Image tokens per image of the tiny vision-language model."""
    side = VLM_VISION["image_size"] // VLM_VISION["patch_size"]
    return side * side // (VLM_SCALE * VLM_SCALE)


def make_tiny_vlm(dst: Path, demo_src: Path, seed: int = 0, peaked: bool = True) -> Path:
    """A tiny random Idefics3 (SmolVLM) model (weights from ``torch.manual_seed(seed)``) with
    a processor built here: the demo tokenizer plus the image tokens, and Idefics3's PIL image
    processor (one 56-pixel image, no tiling). ``peaked``: the tied embedding (and head) is
    scaled to unit variance, so next-token logits spread wide (std ~8) and greedy decoding is
    not decided by near-ties."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    tok = transformers.AutoTokenizer.from_pretrained(demo_src)
    tok.add_special_tokens({"additional_special_tokens": list(VLM_TOKENS)})
    image_id = tok.convert_tokens_to_ids("<image>")
    text = tiny_config("llama", VLM_SHAPE, VLM_VOCAB).to_dict()
    config = transformers.Idefics3Config(
        text_config=text, vision_config=dict(VLM_VISION), image_token_id=image_id,
        scale_factor=VLM_SCALE, tie_word_embeddings=False, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    side = VLM_VISION["image_size"]
    images = transformers.Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": side}, max_image_size={"longest_edge": side})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tok,
                                               image_seq_len=vlm_image_tokens())
    processor.save_pretrained(dst)
    if peaked:
        path = dst / "model.safetensors"
        tensors = load_file(str(path))
        head = tensors["lm_head.weight"].float()
        tensors["lm_head.weight"] = (head / head.std()).to(torch.bfloat16)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return dst
