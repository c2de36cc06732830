"""The pass worker of the ``bit_identity`` suite (``benchmarks/suites/bit_identity.py``): runs
one arm's command and writes the digest of every tensor it wrote.

    python -m benchmarks.bit_identity --arm ARM --tree TREE --src CKPT --out DIR --json OUT
                                      [--smoke]

The command (:data:`COMMANDS`) runs as ``python -m cpu_quant.cli ...`` from the source tree
``TREE`` (``PYTHONPATH=TREE``, in ``DIR``): the suite's reference revision or this checkout.
Digests
(:func:`output_digests`): every tensor of every ``*.safetensors`` file under ``DIR`` (sha256 of
its bytes, with its dtype and shape, keyed by the file's directory and the tensor's name,
whatever the sharding), and the sha256 of every ``*.gguf`` and ``*.pte`` file. Output:
``{"argv", "exit_status", "digests": {key: digest}, "digest": sha256 over all of them}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "cpu_quant.cli"]
# the byte-identity acceptance of the redesign (issue 42): arm -> cpu-quant arguments after
# "SRC DST"; the calibration flags are added by the suite (defaults in a real run)
# The calibration is pinned to the Austen corpus, the built-in default before the mix became it
# (a change of the default's outputs by design, not of the code's), so that a reference from
# either side of that change runs the same calibration: a tree from before the named
# calibrations (no ``cpu_quant/data/mix.py``) runs without the flag, which there means Austen.
PIN = ["--calib", "austen"]
COMMANDS = {  # the longest first: a run stopped early has compared it
    "phone-8da4w": ["export-phone", "--backend", "xnnpack", "--scheme", "8da4w", *PIN],
    "formats": ["gptq", *PIN, "--format", "gptq,cpu_int4,gguf", "--no-eval"],
    "tinygemm": ["tinygemm", *PIN, "--no-eval"],
    "gptq": ["gptq", *PIN, "--no-eval"],
}
# smoke: a small calibration and, for the phone program, small static shapes
SMOKE_FLAGS = {"gptq": ["--samples", "4", "--seqlen", "64"],
               "phone-8da4w": ["--samples", "4", "--seqlen", "64", "--max-seq-len", "48",
                               "--prefill-len", "16", "--calib-samples", "1"]}
FILE_SUFFIXES = (".gguf", ".pte")


def tensor_digests(directory: Path) -> dict[str, str]:
    """Every tensor of ``directory``'s ``*.safetensors`` files: name -> "sha256 dtype shape"."""
    import torch
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                t = h.get_tensor(name).contiguous()
                raw = t.view(-1).view(torch.uint8).numpy().tobytes()
                out[name] = f"{hashlib.sha256(raw).hexdigest()} {t.dtype} {tuple(t.shape)}"
    return out


def compare(a: Path, b: Path) -> dict:
    """Two directories' tensors compared by name."""
    da, db = tensor_digests(a), tensor_digests(b)
    differ = sorted(k for k in set(da) & set(db) if da[k] != db[k])
    return {"tensors_a": len(da), "tensors_b": len(db), "only_in_a": sorted(set(da) - set(db)),
            "only_in_b": sorted(set(db) - set(da)), "differing": differ,
            "identical": not differ and set(da) == set(db) and bool(da)}


def output_digests(root: Path) -> dict[str, str]:
    """Every tensor of every safetensors directory under ``root`` (``dir/name``) and every
    GGUF and ExecuTorch file (``path``), relative to ``root``."""
    root = Path(root)
    out: dict[str, str] = {}
    for d in sorted({f.parent for f in root.rglob("*.safetensors")}):
        rel = d.relative_to(root).as_posix()
        out.update({f"{rel}/{name}": v for name, v in tensor_digests(d).items()})
    for f in sorted(p for p in root.rglob("*") if p.suffix in FILE_SUFFIXES):
        out[f.relative_to(root).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def differences(reference: dict[str, str], run: dict[str, str]) -> dict:
    """What differs between two :func:`output_digests`: keys only on one side, and different."""
    return {"only_in_reference": sorted(set(reference) - set(run)),
            "only_in_run": sorted(set(run) - set(reference)),
            "differing": sorted(k for k in set(reference) & set(run) if reference[k] != run[k])}


def combined(digests: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def named_calibrations(tree: Path) -> bool:
    """Does the source tree know ``--calib austen`` (the named calibrations)?"""
    return (Path(tree) / "cpu_quant" / "data" / "mix.py").is_file()


def command(arm: str, src: Path, out: Path, smoke: bool, tree: Path | None = None) -> list[str]:
    first, *rest = COMMANDS[arm]
    if tree is not None and not named_calibrations(tree):
        i = rest.index(PIN[0])
        rest = rest[:i] + rest[i + len(PIN):]
    flags = SMOKE_FLAGS.get(arm, SMOKE_FLAGS["gptq"]) if smoke else []
    return [*CLI, first, str(src), str(out / "output"), *rest, *flags]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bit_identity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", choices=sorted(COMMANDS), required=True)
    ap.add_argument("--tree", type=Path, required=True, help="the source tree to run from")
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if not (args.src / "config.json").is_file():
        print(f"error: {args.src} holds no config.json", file=sys.stderr)
        return 2
    if not (args.tree / "cpu_quant" / "__init__.py").is_file():
        print(f"error: {args.tree} is not a cpu-quant source tree", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    argv_run = command(args.arm, args.src.resolve(), args.out.resolve(), args.smoke, args.tree)
    env = {**os.environ, "PYTHONPATH": str(args.tree.resolve())}
    proc = subprocess.run(argv_run, stdout=subprocess.DEVNULL, cwd=args.out, env=env)
    if proc.returncode != 0:
        print(f"error: {' '.join(argv_run)} exited {proc.returncode}", file=sys.stderr)
        return 1
    digests = output_digests(args.out / "output")
    if not digests:
        print(f"error: {args.out / 'output'} holds no tensors", file=sys.stderr)
        return 1
    args.json.write_text(json.dumps({"argv": argv_run, "tree": str(args.tree.resolve()),
                                     "exit_status": proc.returncode, "digests": digests,
                                     "digest": combined(digests)}))
    print(f"{args.arm}: {len(digests)} digests, {combined(digests)[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
