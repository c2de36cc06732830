"""Kill a real quantization run at scripted points, resume it, and compare with an uninterrupted run.

The pass worker of the ``kill_resume`` suite (``benchmarks/suites/kill_resume.py``):

``python -m benchmarks.kill_resume --json OUT [--layers 8] [--work DIR]``

Builds a small random model (``benchmarks.suites.memory.synthetic_model``, the smoke shapes:
hidden 64, ``--layers`` decoder layers, the demo tokenizer), quantizes it once uninterrupted,
then once per kill point with ``CPU_QUANT_KILL_AT=EVENT:N:SIGNAL`` (the testing hook
``cpu_quant.quantize.signals.kill_point``: the run sends itself SIGNAL the Nth time it reaches
EVENT), and runs the same command again with ``--resume``. Kill points are events, not delays,
so each lands where it is named on a loaded machine too.

Each point's outcome is one of:

* ``identical``: the resumed artifact's tensors (sha256 of each tensor's bytes, every shard)
  equal the uninterrupted run's;
* ``refused``: the resume exited non-zero with exactly one ``error:`` line and no traceback;
* ``finished``: the signal came while the finished artifact was being written, the run completed
  (exit 0) and its tensors are identical;
* ``FAILED``: anything else (a traceback, different tensors, a kill that did not happen, a
  SIGINT or SIGTERM that took more than ``STOP_LIMIT_S`` to stop the run, or whose message names
  other layers than the resume point on disk holds).

For SIGINT and SIGTERM the hook stamps the time it sends the signal
(``CPU_QUANT_KILL_STAMP``); ``stop_seconds`` is the time from it to the run's exit, and
``saved_layers`` the completed layers of the resume point the run left.

``OUT`` lists every point with its exit codes, the resume's message and the outcome; the
worker exits 1 when any point failed.
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
from dataclasses import asdict, dataclass
from pathlib import Path

from .suites.memory import synthetic_model

CLI = [sys.executable, "-m", "cpu_quant.cli"]
CALIB = ["--group", "32", "--samples", "4", "--seqlen", "64", "--batch-size", "2", "--no-eval"]
STOP_LIMIT_S = 5.0  # "stops within a few seconds at any phase"


@dataclass(frozen=True)
class KillPoint:
    event: str
    n: int
    signal: str = "SIGKILL"
    offload: bool = False  # run with --offload-activations (the resume runs in memory)

    @property
    def spec(self) -> str:
        return f"{self.event}:{self.n}:{self.signal}"


def kill_points(layers: int) -> list[KillPoint]:
    """At least 20 points over every phase; the last layer is ``layers``."""
    mid, last = max(2, layers // 2), layers
    return [
        KillPoint("calibration", 1),
        KillPoint("layer-start", 1), KillPoint("layer-start", mid), KillPoint("layer-start", last),
        KillPoint("layer-computed", 1), KillPoint("layer-computed", last),
        KillPoint("layer-end", 1), KillPoint("layer-end", mid), KillPoint("layer-end", last),
        # the in-memory resume point's write window: activations in place, state not yet written
        KillPoint("resume-activations", 1), KillPoint("resume-activations", mid),
        KillPoint("resume-activations", last),
        KillPoint("resume-state", 2), KillPoint("resume-state", last),
        KillPoint("head", 1),
        KillPoint("final-write", 1),
        KillPoint("commit", 1),
        KillPoint("layer-end", mid, offload=True), KillPoint("layer-computed", 2, offload=True),
        KillPoint("calibration", 1, "SIGINT"),
        KillPoint("layer-start", mid, "SIGINT"),
        KillPoint("layer-computed", mid, "SIGTERM"),
        KillPoint("resume-activations", 2, "SIGTERM"),
        KillPoint("head", 1, "SIGINT"),
        KillPoint("head", 1, "SIGTERM"),
        KillPoint("final-write", 1, "SIGINT"),
        KillPoint("calibration", 1, "SIGTERM"),
        KillPoint("layer-end", 1, "SIGINT"),
        KillPoint("layer-start", last, "SIGTERM"),
        KillPoint("resume-state", mid, "SIGINT"),
        KillPoint("resume-activations", mid, "SIGTERM"),
    ]


def tensor_digests(directory: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name).contiguous()
                out[name] = hashlib.sha256(t.view(-1).view(dtype=_u8()).numpy().tobytes()).hexdigest()
    return out


def _u8():
    import torch

    return torch.uint8


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, **(env or {})))


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def _saved_layers(staging: Path) -> int:
    """The completed layers of the resume point in ``staging`` (0: none)."""
    try:
        return int(json.loads((staging / "cpu_quant_state.json").read_text())["completed_layers"])
    except (OSError, ValueError, KeyError):
        return 0


def _message_names(message: str, saved: int) -> bool:
    """Does a stop message say what the resume point holds?"""
    if saved == 0:
        return "nothing was saved" in message
    return (f"layers 1-{saved} of" in message if saved > 1 else "layer 1 of" in message) \
        and "--resume" in message


def run_point(point: KillPoint, src: Path, work: Path, baseline: dict[str, str]) -> dict:
    dst = work / f"kp-{point.event}-{point.n}-{point.signal}{'-offload' if point.offload else ''}"
    args = ["gptq", str(src), str(dst), *CALIB]
    stamp = work / f".{dst.name}.stamp"
    stamp.unlink(missing_ok=True)
    t0 = time.monotonic()
    first = _run(args + (["--offload-activations"] if point.offload else []),
                 {"CPU_QUANT_KILL_AT": point.spec, "CPU_QUANT_KILL_STAMP": str(stamp)})
    ended = time.time()
    rec = {**asdict(point), "kill_exit": first.returncode,
           "kill_message": (_error_lines(first.stderr) or [""])[-1],
           "kill_traceback": "Traceback" in first.stderr}
    if point.signal != "SIGKILL" and first.returncode != 0:
        saved = _saved_layers(dst.parent / f".{dst.name}.partial")
        stop = round(ended - float(stamp.read_text()), 2) if stamp.is_file() else None
        rec.update(stop_seconds=stop, saved_layers=saved,
                   message_names_saved=_message_names(rec["kill_message"], saved))
        if stop is None or stop > STOP_LIMIT_S or not rec["message_names_saved"]:
            rec.update(outcome="FAILED", seconds=round(time.monotonic() - t0, 1))
            return rec
    stamp.unlink(missing_ok=True)
    if first.returncode == 0:  # the signal arrived while the artifact was being written
        same = dst.is_dir() and tensor_digests(dst) == baseline
        rec.update(outcome="finished" if same and point.signal != "SIGKILL" else "FAILED",
                   seconds=round(time.monotonic() - t0, 1))
        return rec
    second = _run(args + ["--resume"])
    errors = _error_lines(second.stderr)
    rec.update(resume_exit=second.returncode, resume_message=errors[-1] if errors else "",
               resume_traceback="Traceback" in second.stderr)
    if rec["kill_traceback"] or rec["resume_traceback"]:
        outcome = "FAILED"
    elif second.returncode == 0:
        digests = tensor_digests(dst)
        rec["differing_tensors"] = sorted(k for k in baseline if digests.get(k) != baseline[k])
        outcome = "identical" if digests == baseline else "FAILED"
    else:
        outcome = "refused" if len(errors) == 1 else "FAILED"
    rec.update(outcome=outcome, seconds=round(time.monotonic() - t0, 1))
    shutil.rmtree(dst, ignore_errors=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kill_resume", description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the random model")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, required=True, help="where the record goes")
    opts = ap.parse_args(argv)
    if opts.layers < 4:
        ap.error("--layers must be >= 4 (the kill points need a middle layer)")
    work = opts.work or Path(tempfile.mkdtemp(prefix="kill-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    src = synthetic_model(work / f"model-{opts.layers}", opts.layers, smoke=True)
    base = work / "uninterrupted"
    shutil.rmtree(base, ignore_errors=True)
    t0 = time.monotonic()
    proc = _run(["gptq", str(src), str(base), *CALIB])
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return 1
    baseline = tensor_digests(base)
    base_seconds = round(time.monotonic() - t0, 1)
    points = []
    for point in kill_points(opts.layers):
        rec = run_point(point, src, work, baseline)
        points.append(rec)
        print(f"{point.spec:<28} {'offload' if point.offload else '':<8} kill exit "
              f"{rec['kill_exit']:>4}  resume exit {rec.get('resume_exit', '-')!s:>4}  "
              f"{rec['outcome']:<9} {rec.get('resume_message', '')[:90]}", flush=True)
    counts = {o: sum(p["outcome"] == o for p in points)
              for o in ("identical", "refused", "finished", "FAILED")}
    settings = {"model": "synthetic smoke shapes (hidden 64)", "layers": opts.layers,
                "calibration": CALIB, "kill_points": len(points), "stop_limit_s": STOP_LIMIT_S}
    stops = sorted(p["stop_seconds"] for p in points if p.get("stop_seconds") is not None)
    result = {"suite": "kill-resume", "settings": settings, "outcomes": counts,
              "stop_seconds": {"n": len(stops), "median": stops[len(stops) // 2] if stops else None,
                               "max": stops[-1] if stops else None},
              "uninterrupted": {"seconds": base_seconds, "tensors": len(baseline),
                                "digest": hashlib.sha256(json.dumps(baseline, sort_keys=True)
                                                         .encode()).hexdigest()},
              "points": points}
    path = opts.json
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    print(f"{counts} -> {path}")
    if opts.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
