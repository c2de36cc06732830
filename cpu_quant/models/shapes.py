"""Random-weight checkpoints with the exact configs of public 1B-8B models, written without a hub.

No model hub is reachable here, and no package registry ships a 1B-8B model. Speed and memory
depend on a model's shapes, not on its values, so these checkpoints carry the published
config of a named model (layer count, widths, heads, vocabulary, RoPE, tied or untied head)
and random weights. **Their fidelity numbers mean nothing**: a quantized random model is
measured for time, memory and whether every runtime loads and runs it, never for quality.

- Weights: every tensor from its own ``torch.Generator`` seeded by the model's seed and the
  tensor's name, so a tensor is the same whatever the shard layout or the order of writing, and
  the checkpoint streams to disk one tensor at a time (an 8B model never sits in memory).
  Linear and embedding weights are normal with the config's ``initializer_range`` (transformers'
  own initialisation), biases zero, norm weights one.
- Tokenizer: the demo model's (SmolLM2, a GPT-2-style byte-level BPE of 49,152 tokens). The
  config keeps the named model's larger ``vocab_size``, as checkpoints with padded vocabularies
  do; vLLM, transformers and llama.cpp's converter accept a tokenizer smaller than the
  embedding. The special-token ids are the demo tokenizer's.
- Cache: ``<cache>/shapes/<name>-seed<seed>-v<VERSION>``, written to a staging directory and
  renamed into place, so a killed write leaves nothing that looks whole.
- Tokenizer and generation config files are the demo model's.
- ``peaked``: a variant whose embedding (and untied head) is normal with standard deviation 1
  instead of 0.02, and whose residual branches' output projections (``o_proj``, ``down_proj``)
  have the standard deviation divided by ``sqrt(2 x layers)`` (GPT-2's scaled initialisation).
  The default's next-token distribution is flat (every logit within a near-tie of the best),
  so a check that compares a quantized program's top-1 tokens with the float model's fails on
  noise alone; the variant's logits are dominated by the embedding's self-similarity, so such
  checks are decided. The scaled projections keep each layer's share of the residual stream
  small: unscaled, a random model's layers amplify a perturbation at every layer, and at
  Llama-3.2-1B's 16 layers the 4-bit GPTQ codes of the unscaled variant gave logits below
  export-phone's SNR floor against the float model's (it refused them). Its final norm's weight is
  0.008 instead of 1: with a unit-variance embedding the token just read sits so far above
  every other that both perplexities overflow and a logit error of a few percent moves their
  ratio by nats; scaled down, the same logits (the same argmax, the same SNR)
  give perplexities of a real model's order. The same shapes and the same
  compute: for speed and memory of a command that refuses to write what it cannot verify
  (``export-phone``). Cached apart (``-peaked`` and its own recipe version in the directory's
  name).

``python -m cpu_quant.models.shapes NAME [--seed N] [--peaked]`` writes one and prints its path.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import CpuQuantError

VERSION = 1  # bump when the weights' recipe changes: the cache key follows
# the peaked variant's recipe (2: its residual output projections scaled; 3: its final norm)
PEAKED_VERSION = 3
# the peaked variant's final norm weight: its logits at a real model's scale (module docstring)
PEAKED_FINAL_NORM = 0.008
FINAL_NORM = "model.norm.weight"
PEAKED_STD = 1.0  # the peaked variant's embedding and untied head (module docstring)
PEAKED_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
# the peaked variant's residual output projections: std / sqrt(2 x layers) (module docstring)
RESIDUAL_OUTPUTS = (".self_attn.o_proj.weight", ".mlp.down_proj.weight")
SHARD_BYTES = 2 * 1024 ** 3

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class PublicShape:
    """The published config of a named model: only what sets a tensor's shape or the compute."""
    name: str  # the public model it copies
    model_type: str
    architecture: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    max_positions: int
    rope_theta: float
    rms_norm_eps: float
    head_dim: int | None = None  # None: hidden // heads
    extra: dict = field(default_factory=dict)

    def config(self) -> dict:
        cfg = {
            "architectures": [self.architecture], "model_type": self.model_type,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied, "max_position_embeddings": self.max_positions,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu", "initializer_range": 0.02, "dtype": "bfloat16",
            "use_cache": True,
        }
        if self.head_dim is not None:
            cfg["head_dim"] = self.head_dim
        cfg.update(self.extra)
        return cfg

    def parameters(self) -> int:
        """Parameters of the linears and the embedding (the tied head counted once; the norms'
        few thousand weights left out)."""
        head_dim = self.head_dim or self.hidden // self.heads
        attn = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp) + embed


# Each row is the model's published config.json (its shape-setting keys).
SHAPES: dict[str, PublicShape] = {s.name: s for s in (
    PublicShape("Llama-3.2-1B", "llama", "LlamaForCausalLM", 2048, 8192, 16, 32, 8, 128256,
                True, 131072, 500000.0, 1e-5, head_dim=64,
                extra={"rope_scaling": _LLAMA3_ROPE, "attention_bias": False, "mlp_bias": False}),
    PublicShape("Llama-3.2-3B", "llama", "LlamaForCausalLM", 3072, 8192, 28, 24, 8, 128256,
                True, 131072, 500000.0, 1e-5, head_dim=128,
                extra={"rope_scaling": _LLAMA3_ROPE, "attention_bias": False, "mlp_bias": False}),
    PublicShape("Qwen2.5-3B", "qwen2", "Qwen2ForCausalLM", 2048, 11008, 36, 16, 2, 151936,
                True, 32768, 1000000.0, 1e-6,
                extra={"sliding_window": None, "use_sliding_window": False}),
    PublicShape("Qwen3-4B", "qwen3", "Qwen3ForCausalLM", 2560, 9728, 36, 32, 8, 151936,
                True, 40960, 1000000.0, 1e-6, head_dim=128,
                extra={"attention_bias": False, "sliding_window": None,
                       "use_sliding_window": False}),
    PublicShape("Llama-3-8B", "llama", "LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128256,
                False, 8192, 500000.0, 1e-5,
                extra={"attention_bias": False, "mlp_bias": False}),
)}


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_tensor(name: str, shape: tuple[int, ...], std: float, seed: int):
    """The bf16 tensor ``name`` of a random model: ones for norms, zeros for biases, else
    normal(0, std), from a generator of its own (module docstring)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, (64 * 1024 ** 2) // max(1, 4 * out[0].numel())) if out.dim() > 1 else out.shape[0]
    for start in range(0, shape[0], rows):  # float32 in slices: bounded temporaries
        block = torch.empty((min(rows, shape[0] - start), *shape[1:]), dtype=torch.float32)
        out[start:start + block.shape[0]] = block.normal_(0.0, std, generator=gen)
    return out


def _shapes_of(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the model ``config`` builds (on the meta device)."""
    import torch
    from transformers import AutoConfig

    from ..core.io.checkpoint import empty_causal_lm

    hf = AutoConfig.for_model(**copy.deepcopy(config))  # transformers edits rope_scaling in place
    model = empty_causal_lm(hf, torch.bfloat16)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    return shapes


def write_random_model(shape: PublicShape, dst: Path, demo_src: Path, seed: int = 0,
                       shard_bytes: int = SHARD_BYTES, progress: bool = True,
                       peaked: bool = False) -> Path:
    """Write the random checkpoint of ``shape`` to ``dst`` (bf16 shards, index, config,
    generation config and the demo tokenizer), through a staging directory; ``peaked``: the
    variant of the module docstring."""
    from tqdm import tqdm

    from ..core.io.artifact import copy_tokenizer_files, write_json_atomic, write_shard_index_at
    from ..core.io.safetensors_writer import write_safetensors

    config = shape.config()
    tok_cfg = json.loads((demo_src / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if tok_cfg.get(key) is not None:
            config[key] = tok_cfg[key]
    shapes = _shapes_of(config)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}-"))
    try:
        groups: list[list[str]] = [[]]
        size = 0
        for name, shp in shapes.items():
            nbytes = 2 * _numel(shp)
            if groups[-1] and size + nbytes > shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
        files = {}
        bar = tqdm(total=len(shapes), desc=f"writing {shape.name} (random)", unit="tensor",
                   disable=not progress)
        total = 0
        for k, names in enumerate(groups):
            fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {}
            for name in names:
                tensors[name] = random_tensor(name, shapes[name], tensor_std(config, name, peaked),
                                              seed)
                if peaked and name == FINAL_NORM:
                    tensors[name] = tensors[name] * PEAKED_FINAL_NORM
                bar.update(1)
            total += write_safetensors(staging / fname, tensors)
            del tensors
            files[fname] = names
        bar.close()
        write_shard_index_at(staging, files, total)
        config["cpu_quant_random_model"] = {"copies": shape.name, "seed": seed,
                                            "version": VERSION,
                                            **({"peaked_std": PEAKED_STD,
                                                "peaked_version": PEAKED_VERSION,
                                                "final_norm": PEAKED_FINAL_NORM,
                                                "residual_output_std": residual_output_std(config)}
                                               if peaked else {})}
        write_json_atomic(staging / "config.json", config)
        copy_tokenizer_files(demo_src, staging)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst


def residual_output_std(config: dict) -> float:
    """The peaked variant's standard deviation of ``o_proj`` and ``down_proj``."""
    return config["initializer_range"] / math.sqrt(2 * config["num_hidden_layers"])


def tensor_std(config: dict, name: str, peaked: bool) -> float:
    """The standard deviation a weight ``name`` is drawn with (module docstring)."""
    if peaked and name in PEAKED_TENSORS:
        return PEAKED_STD
    if peaked and name.endswith(RESIDUAL_OUTPUTS):
        return residual_output_std(config)
    return config["initializer_range"]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def random_model_path(name: str, seed: int = 0, progress: bool = True, peaked: bool = False
                      ) -> Path:
    """The cached random checkpoint of the public model ``name`` (written on first use);
    ``peaked``: its variant of the module docstring."""
    from ..core.cache import cache_dir
    from .demo import demo_model_path

    if name not in SHAPES:
        raise CpuQuantError(f"no public shape named {name!r}; known: {', '.join(SHAPES)}")
    variant = f"-peaked-v{PEAKED_VERSION}" if peaked else ""
    target = cache_dir() / "shapes" / f"{name}-seed{seed}{variant}-v{VERSION}"
    if (target / "config.json").is_file() and (target / "model.safetensors.index.json").is_file():
        return target
    return write_random_model(SHAPES[name], target, demo_model_path(), seed, progress=progress,
                              peaked=peaked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpu_quant.models.shapes",
                                     description="write a random checkpoint of a public model's shape")
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peaked", action="store_true",
                        help="the variant with a unit-variance embedding (module docstring)")
    args = parser.parse_args(argv)
    try:
        print(random_model_path(args.name, args.seed, peaked=args.peaked))
    except CpuQuantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
