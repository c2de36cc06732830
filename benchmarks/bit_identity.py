"""Are two artifacts the same weights? The sha256 of every tensor, compared by name.

    python -m benchmarks.bit_identity A_DIR B_DIR --label NAME [--note TEXT] [--out DIR]

Reads every ``*.safetensors`` file of both directories (whatever their sharding), hashes each
tensor's bytes together with its dtype and shape, and reports the tensors only in A, only in B
and those that differ. Result file: ``<out>/bit-identity-<label>-<UTC time>.json`` (atomic),
with both directories' commands as given by ``--note`` and the benchmark provenance (git SHA,
CPU, package versions). Exits 1 when any tensor differs or is missing on one side.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from . import provenance
from .harness import write_result

RESULTS = Path(__file__).resolve().parent / "results"


def tensor_digests(directory: Path) -> dict[str, str]:
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
    da, db = tensor_digests(a), tensor_digests(b)
    differ = sorted(k for k in set(da) & set(db) if da[k] != db[k])
    return {"tensors_a": len(da), "tensors_b": len(db), "only_in_a": sorted(set(da) - set(db)),
            "only_in_b": sorted(set(db) - set(da)), "differing": differ,
            "identical": not differ and set(da) == set(db) and bool(da)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bit_identity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--label", required=True)
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    for d in (args.a, args.b):
        if not d.is_dir():
            print(f"error: {d} is not a directory", file=sys.stderr)
            return 2
    result = compare(args.a, args.b)
    prov = provenance.collect({"a": str(args.a), "b": str(args.b)},
                              {"a": args.a, "b": args.b})
    provenance.validate(prov)
    doc = {"suite": "bit-identity", "label": args.label, "notes": args.note, **result,
           "provenance": prov}
    path = write_result(args.out, f"bit-identity-{args.label}", doc)
    print(f"{args.label}: {result['tensors_a']} vs {result['tensors_b']} tensors, "
          f"{len(result['differing'])} differ, identical={result['identical']}; wrote {path}")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
