"""The pass worker of the scale suite's ``checks`` part: the commands besides ``gptq`` at one
size, on the quantize part's artifact (``benchmarks/suites/scale.py``).

    python -m benchmarks.scale_checks SRC ART --samples S --seqlen L --batch-size B --json OUT
        [--only-rerun] [--resume-at N] [--nproc]

``ART`` holds the quantize part's ``gptq``, ``cpu_int4`` and ``gguf`` outputs of ``SRC`` (one
``cpu-quant gptq --format gptq,cpu_int4,gguf`` run with the given calibration). Steps, in order,
each a ``cpu-quant`` command in its own process:

Unless ``--only-rerun``:

- ``verify-F`` and ``inspect-F`` for each format F: exit 0, and verify prints no ``ERROR``;
- ``convert``: ``convert ART/gptq --to cpu_int4``, whose tensors must equal ``ART/cpu_int4``'s
  bit for bit (the same codes, repacked);
- ``eval``: ``eval ART/gptq --reference SRC`` on a short held-out set: it runs and fits (a
  random model's fidelity means nothing);
Then:

- with ``--resume-at N``: the same ``gptq`` run killed (SIGKILL) at the end of layer N, then
  ``--resume``: every output (tensors, and the GGUF file's bytes) must equal ``ART``'s;
- with ``--nproc``: the same run with ``--nproc 2 --threads 1``: every output must equal ``ART``'s.

Each step's record: argv, exit status, wall seconds, peak RssAnon of its process tree, whether
it held (``ok``) and what was compared. Output: ``{"steps": [...], "ok": all held}``; the
worker exits 0 when every step held, 1 otherwise (the JSON is written either way).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .rss import TreeRssSampler
from .suites.scale import FORMATS as SCALE_FORMATS

CLI = [sys.executable, "-m", "cpu_quant.cli"]
FORMATS = tuple(SCALE_FORMATS.split(","))  # the quantize part's
EVAL = ["--windows", "4", "--seqlen", "256", "--prompts", "2", "--new-tokens", "8"]


def tensor_digests(directory: Path) -> dict[str, str]:
    """sha256 of every tensor of every safetensors file under ``directory``, and of every GGUF
    file's bytes: what two runs must share to be the same artifact."""
    import torch
    from safetensors import safe_open

    out = {}
    for f in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                t = h.get_tensor(name).contiguous()
                out[f"{f.relative_to(directory).parent}/{name}"] = hashlib.sha256(
                    t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    for f in sorted(directory.rglob("*.gguf")):
        digest = hashlib.sha256()
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                digest.update(chunk)
        out[str(f.relative_to(directory))] = digest.hexdigest()
    return out


def _differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def run_step(name: str, argv: list[str], env: dict | None = None, timeout: int = 4 * 3600
             ) -> dict:
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))
    sampler = TreeRssSampler(proc.pid).start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    sampler.stop()
    return {"step": name, "argv": argv[len(CLI):], "env": env or {}, "exit_status": proc.returncode,
            "wall_seconds": round(time.monotonic() - t0, 2),
            "peak_rss_anon_bytes": sampler.peak_bytes,
            "stdout_tail": out[-1500:], "stderr_tail": err[-1500:]}



def _compared(rec: dict, out: Path, reference: dict[str, str], what: str) -> dict:
    """``rec`` held when its command exited 0 and ``out``'s digests equal ``reference``."""
    if rec["exit_status"] == 0:
        diff = _differing(tensor_digests(out), reference)
        rec["compared"], rec["differing"], rec["ok"] = what, diff[:20], not diff
    else:
        rec["ok"] = False
    return rec


def _inspect(args: argparse.Namespace, work: Path, steps: list[dict]) -> None:
    """verify and inspect every format, convert, eval."""
    for fmt in FORMATS:
        target = args.art / fmt
        if fmt == "gguf":
            target = next(target.glob("*.gguf"))
        rec = run_step(f"verify-{fmt}", [*CLI, "verify", str(target)])
        rec["ok"] = rec["exit_status"] == 0 and "ERROR" not in rec["stdout_tail"]
        steps.append(rec)
        rec = run_step(f"inspect-{fmt}", [*CLI, "inspect", str(target)])
        rec["ok"] = rec["exit_status"] == 0
        steps.append(rec)
    converted = work / "converted"
    rec = run_step("convert", [*CLI, "convert", str(args.art / "gptq"), str(converted),
                               "--to", "cpu_int4"])
    steps.append(_compared(rec, converted, tensor_digests(args.art / "cpu_int4"),
                           "tensors against the run's cpu_int4 output"))
    shutil.rmtree(converted, ignore_errors=True)
    rec = run_step("eval", [*CLI, "eval", str(args.art / "gptq"), "--reference", str(args.src),
                            *EVAL])
    rec["ok"] = rec["exit_status"] == 0
    steps.append(rec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale_checks",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("art", type=Path)
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--seqlen", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--resume-at", type=int, default=None, metavar="N",
                    help="kill a run at the end of layer N, resume it, compare")
    ap.add_argument("--nproc", action="store_true", help="a two-process run, compared")
    ap.add_argument("--only-rerun", action="store_true",
                    help="skip verify, inspect, convert and eval")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    missing = [f for f in FORMATS if not (args.art / f).is_dir()]
    if missing:
        ap.error(f"{args.art} has no {', '.join(missing)} output: run the quantize part first")

    steps: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="scale-checks-", dir=args.json.parent))
    try:
        if not args.only_rerun:
            _inspect(args, work, steps)
        same = ["gptq", str(args.src), "--samples", str(args.samples), "--seqlen", str(args.seqlen),
                "--batch-size", str(args.batch_size), "--format", ",".join(FORMATS), "--no-eval",
                "--quiet"]
        reference = tensor_digests(args.art) if args.resume_at is not None or args.nproc else {}
        if args.resume_at is not None:
            out = work / "resumed"
            rec = run_step("killed", [*CLI, *same[:2], str(out), *same[2:]],
                           env={"CPU_QUANT_KILL_AT": f"layer-end:{args.resume_at}:SIGKILL"})
            rec["ok"] = rec["exit_status"] == -9
            steps.append(rec)
            steps.append(_compared(run_step("resume", [*CLI, *same[:2], str(out), *same[2:],
                                                       "--resume"]),
                                   out, reference, "every output against the uninterrupted run's"))
            shutil.rmtree(out, ignore_errors=True)
        if args.nproc:
            out = work / "nproc2"
            steps.append(_compared(run_step("nproc2", [*CLI, *same[:2], str(out), *same[2:],
                                                       "--nproc", "2", "--threads", "1"]),
                                   out, reference, "every output against the one-process run's"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ok = bool(steps) and all(s["ok"] for s in steps)
        args.json.write_text(json.dumps({"steps": steps, "ok": ok}, indent=1) + "\n")
    for s in steps:
        print(f"{s['step']}: {'held' if s['ok'] else 'FAILED'} (exit {s['exit_status']}, "
              f"{s['wall_seconds']:.0f} s, peak {s['peak_rss_anon_bytes'] / 2**30:.2f} GiB)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
