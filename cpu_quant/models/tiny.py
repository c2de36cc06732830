"""Tiny random decoder-only models of every architecture cpu-quant supports, with the demo
tokenizer: the unit tests' models (:data:`UNIT`) and the larger ones of the ``fidelity_archs``
benchmark (``benchmarks/suites/fidelity_archs.py``), from one definition.

A model is a transformers config class, the few keys its architecture needs
(:data:`TINY_ARCHS`), a :class:`TinyShape` and a seed; it is saved as bf16 safetensors with the
demo model's tokenizer files, so the same seed and shape always give the same weights.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEMO_VOCAB = 49152  # the demo tokenizer's vocabulary
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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# the unit tests' models: small enough to quantize in a second
UNIT = TinyShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)


def _head_dim(shape: TinyShape) -> dict:
    return {"head_dim": shape.head_dim}


def _gemma(shape: TinyShape) -> dict:
    return {"head_dim": shape.head_dim, "query_pre_attn_scalar": shape.head_dim,
            "sliding_window": 64}


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


def tiny_config(arch: str, shape: TinyShape = UNIT, vocab: int = DEMO_VOCAB):
    """The transformers config of a tiny ``arch`` model of ``shape``."""
    import transformers

    cls_name, extra = TINY_ARCHS[arch]
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


def copy_tokenizer(demo_src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (demo_src / name).exists():
            shutil.copy(demo_src / name, dst / name)


def make_tiny_model(arch: str, dst: Path, demo_src: Path, seed: int = 0, vocab: int = DEMO_VOCAB,
                    shape: TinyShape = UNIT) -> Path:
    """A tiny random ``arch`` model of ``shape`` (weights from ``torch.manual_seed(seed)``),
    saved to ``dst`` as bf16 safetensors with the demo tokenizer."""
    import torch
    import transformers

    config = tiny_config(arch, shape, vocab)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    copy_tokenizer(demo_src, dst)
    return dst
