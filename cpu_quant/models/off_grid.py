"""A copy of a checkpoint moved off every quantization grid: the judging models of the
calibration benchmark.

Every model the package registries ship here was stored as a GGUF quantization and dequantized
(the demo model from Q4_1), so its weights sit on that grid and a method on the same grid looks
near-lossless (``core/source_grid.py``). Where no real model off a 4-bit grid exists, the
benchmark judges on such a model **with a small deterministic perturbation**: every 2-D float
weight (the linears, the head and the embeddings) gets Gaussian noise of standard deviation
``rel`` × the RMS of its row (``rel`` = 0.02 by default), from a generator seeded by the seed and
the tensor's name, computed in float32 and stored in the source's dtype. The result is a
different model from the one the registry ships (its outputs move a little); it is used only as
a bf16 source to judge quantization against, and :func:`perturb_off_grid` refuses to return one
whose linears still sit on a grid (``checkpoint_grid``).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from ..core.errors import CpuQuantError

DEFAULT_REL = 0.02


def _generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def perturbed(name: str, weight, rel: float, seed: int):
    """``weight`` plus noise of ``rel`` × each row's RMS (2-D float weights; others as they are)."""
    import torch

    if weight.ndim != 2 or not weight.is_floating_point():
        return weight
    w = weight.float()
    rms = w.pow(2).mean(1, keepdim=True).sqrt()
    noise = torch.randn(w.shape, generator=_generator(seed, name), dtype=torch.float32)
    return (w + rel * rms * noise).to(weight.dtype)


def perturb_off_grid(src: str | Path, dst: str | Path, rel: float = DEFAULT_REL,
                     seed: int = 0) -> Path:
    """``src`` (one safetensors file of a small model) perturbed into ``dst``, checked to sit on
    no grid of 5 bits or fewer; the config and tokenizer files copied."""
    from safetensors.torch import load_file

    from ..core.io.checkpoint import open_checkpoint
    from ..core.io.safetensors_writer import write_safetensors
    from ..core.source_grid import checkpoint_grid

    src, dst = Path(src), Path(dst)
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise CpuQuantError(f"{src}: perturb_off_grid reads one model.safetensors file")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: perturbed(k, v, rel, seed) for k, v in load_file(str(weights)).items()}
    write_safetensors(dst / "model.safetensors", tensors)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    ckpt = open_checkpoint(dst)
    try:
        grid = checkpoint_grid(ckpt)
    finally:
        ckpt.close()
    if grid.on_a_grid or any(lin.grid != "no grid of 5 bits or fewer" for lin in grid.linears):
        raise CpuQuantError(f"{dst}: still on a grid after the perturbation ({grid.summary()})")
    return dst
