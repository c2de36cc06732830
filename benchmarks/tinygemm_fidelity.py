"""The build worker of the ``tinygemm_fidelity`` suite's ``asym_shared`` arm
(``benchmarks/suites/tinygemm_fidelity.py``): a ``cpu-quant tinygemm`` artifact whose input
embedding is its own 4-bit head dequantized to bf16, exactly what a model whose lookup shares
the head's 4-bit tensor computes (a lookup dequantizes one row, then everything is bf16).

    python -m benchmarks.tinygemm_fidelity OUT -- cpu-quant ARGS...

runs ``python -m cpu_quant.cli ARGS`` (which must write its artifact to ``OUT.asym``) and
writes the variant to ``OUT``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def shared_embedding_variant(asym: Path, dst: Path) -> Path:
    """``asym`` with ``embed_tokens`` = its dequantized 4-bit head (bf16)."""
    import torch
    from safetensors.torch import load_file, save_file

    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.formats.cpu_int4.layout import dequantize_cpu_int4

    ckpt = open_checkpoint(asym)
    emb = next(n for n in ckpt.names if n.endswith("embed_tokens.weight"))
    head = dequantize_cpu_int4(ckpt.tensor("lm_head.weight_packed"),
                               ckpt.tensor("lm_head.weight_scale"),
                               ckpt.tensor("lm_head.weight_zero")).to(torch.bfloat16)
    if tuple(head.shape) != tuple(ckpt.shape(emb)):
        raise SystemExit(f"head {list(head.shape)} and {emb} {list(ckpt.shape(emb))} differ")
    shard = ckpt.files[emb]
    ckpt.close()
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in asym.iterdir():
        if f.is_file() and f != shard:
            shutil.copyfile(f, dst / f.name)
    tensors = load_file(str(shard))
    tensors[emb] = head.contiguous()
    save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
    return dst


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m benchmarks.tinygemm_fidelity OUT -- cpu-quant ARGS...",
              file=sys.stderr)
        return 2
    out = Path(argv[0])
    asym = out.with_name(out.name + ".asym")
    proc = subprocess.run([sys.executable, "-m", "cpu_quant.cli", *argv[2:]])
    if proc.returncode != 0 or not (asym / "config.json").is_file():
        print(f"error: cpu-quant exited {proc.returncode} without writing {asym}",
              file=sys.stderr)
        return 1
    shared_embedding_variant(asym, out)
    shutil.rmtree(asym)
    return 0


if __name__ == "__main__":
    sys.exit(main())
