"""Fidelity behind two cpu_int4 choices: the asymmetric grid, and a bf16 input embedding.

    python -m benchmarks.tinygemm_fidelity --asym DIR --sym DIR [--reference SRC]
                                           [--windows 32 --seqlen 512] [--workdir DIR]

Every arm is scored by ``cpu-quant eval`` (its own process, held-out text, float32) against the
bf16 source:

``asym``         ``cpu-quant tinygemm`` (asymmetric grid, the default), embedding bf16
``sym``          the symmetric grid as cpu_int4 (``cpu-quant gptq`` -> ``convert``, or
                 ``tinygemm --sym``), same calibration and groups
``asym_shared``  ``asym`` with its input embedding replaced by its 4-bit head dequantized to
                 bf16: exactly what a model whose lookup shares the head's 4-bit tensor
                 computes (a lookup dequantizes one row, then everything is bf16)

The result (all three reports, the artifacts' hashes, provenance) goes to
``benchmarks/results/tinygemm-fidelity-<UTC stamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .provenance import collect, validate

RESULTS = Path(__file__).resolve().parent / "results"


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


def cli_eval(artifact: Path, reference: Path, out: Path, windows: int, seqlen: int) -> dict:
    cmd = [sys.executable, "-m", "cpu_quant.cli", "eval", str(artifact), "--reference",
           str(reference), "--windows", str(windows), "--seqlen", str(seqlen), "--output-json", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(out.read_text())["fidelity"]["weights"]
    report["eval_seconds"] = round(time.perf_counter() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--asym", required=True)
    parser.add_argument("--sym", required=True)
    parser.add_argument("--reference", default=None, help="bf16 source (default: the demo model)")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.reference is None:
        from cpu_quant.models.demo import demo_model_path

        args.reference = str(demo_model_path())
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = Path(args.workdir or f"/tmp/cpu-quant-bench/tinygemm-fidelity-{stamp}")
    work.mkdir(parents=True, exist_ok=True)
    asym, sym, ref = Path(args.asym), Path(args.sym), Path(args.reference)
    arms = {"asym": asym, "sym": sym,
            "asym_shared": shared_embedding_variant(asym, work / "asym_shared")}
    reports = {}
    for name, path in arms.items():
        reports[name] = cli_eval(path, ref, work / f"{name}.json", args.windows, args.seqlen)
        r = reports[name]
        print(f"{name:12s} KL {r['kl_mean']:.4f}  top-1 {r['top1_agreement']:.3f}  "
              f"ppl {r['ppl_quantized']:.2f} ({r['ppl_delta']:+.2f})", file=sys.stderr)
    settings = {"windows": args.windows, "seqlen": args.seqlen, "command": "cpu-quant eval",
                "dtype": "float32"}
    prov = collect(settings, {"reference": ref, **arms})
    validate(prov)
    result = {"suite": "tinygemm-fidelity", "reports": reports, "provenance": prov}
    out = Path(args.out) / f"tinygemm-fidelity-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
