"""Where does the peak come from? A diagnostic trace of one ``cpu-quant gptq`` run, in-process.

The pass worker of the ``memory_trace`` suite (``benchmarks/suites/memory_trace.py``):

``python -m benchmarks.memory_trace --json OUT --depth 4 [--samples 8] [--seqlen 512]
[--batch-size 8] [--interval 0.02] [--workdir DIR] [--smoke]``

``python -m benchmarks.memory_trace --json OUT --model demo [--build default|plain]
[--samples 128] ...``

``python -m benchmarks.memory_trace --json OUT --model Llama-3.2-1B [--samples 8] [--layers N] ...``

Runs the quantizer through its API (``quantize_checkpoint``) while a sampler thread reads this
process's ``RssAnon`` every ``--interval`` seconds. The model: the memory suite's synthetic one
at ``--depth`` times the demo model's 30 layers, with the memory suite's settings (the plain
build: no smoothing, the run's group everywhere it fits); or, with ``--model demo``, the demo
model with the fidelity suite's calibration (128 x 512 unless given) and one of its builds:
``default`` is what ``cpu-quant gptq`` does with no fidelity flag (its ``gptq+head`` arm),
``plain`` its ``gptq+head-plain`` arm (no smoothing, head and down projections in the run's
group); or, with a public model's name, its random-weight model of the same shapes
(``cpu_quant.models.shapes``: memory only, its fidelity means nothing) with every default of
the gptq command but the calibration's size; ``--layers N`` keeps its first ``N`` decoder
layers (the same tensors, written to the workdir), so that one layer's peak at a large shape
is seen in minutes instead of hours. Each time a new maximum is
seen, it records the Python stack of every thread (innermost frames last) and glibc's
``mallinfo2`` (bytes in use on the heaps, free on the heaps, and in direct mmaps). It also records
``RssAnon`` and ``mallinfo2`` after every completed layer.

A diagnostic: its output (``OUT``) says which code the peak happens in, so that a fix can be
aimed; the memory suite then measures the fix.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

from cpu_quant.core.memory import anon_rss_bytes, libc

from .peers import gptqmodel_env
from .provenance import collect as collect_provenance
from .suites.memory import REAL, synthetic_model

DEMO_SAMPLES = 128  # the fidelity suite's calibration: 128 x 512
# the fidelity suite's builds as settings: "default" is the gptq command with no fidelity flag
# (smoothing where it applies, the head and down projections in their default groups)
DEMO_BUILDS = {"default": {"smooth": None},
               "plain": {"smooth": False, "head_group": REAL["group"], "down_group": REAL["group"]}}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    fn = getattr(libc(), "mallinfo2", None)  # glibc >= 2.33
    if fn is None:
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


def rss_anon() -> int:
    return anon_rss_bytes(tree=False)


class Tracer:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.t0 = time.perf_counter()
        self.peak = 0
        self.peaks: list[dict] = []
        self.series: list[tuple[float, int]] = []
        self.layers: list[dict] = []
        self._mi = _mallinfo2()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def malloc(self) -> dict | None:
        if self._mi is None:
            return None
        m = self._mi()
        return {"heap_in_use": m.uordblks, "heap_free": m.fordblks, "heap_total": m.arena,
                "mmapped": m.hblkhd, "mmapped_chunks": m.hblks}

    def _stacks(self) -> dict:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        out = {}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            frames = traceback.extract_stack(frame)[-8:]
            out[names.get(ident, str(ident))] = [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                                  for f in frames]
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            now = rss_anon()
            t = round(time.perf_counter() - self.t0, 3)
            if not self.series or abs(now - self.series[-1][1]) >= (1 << 20):
                self.series.append((t, now >> 20))
            if now > self.peak:
                rising = now - self.peak
                self.peak = now
                if rising >= (4 << 20) or not self.peaks:
                    self.peaks.append({"t": t, "rss_anon_mib": now >> 20, "malloc": self.malloc(),
                                       "stacks": self._stacks()})
            self._stop.wait(self.interval)

    def on_layer(self, i: int, n: int) -> None:
        self.layers.append({"layer": i, "t": round(time.perf_counter() - self.t0, 3),
                            "rss_anon_mib": rss_anon() >> 20, "malloc": self.malloc()})

    def __enter__(self) -> Tracer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory_trace",
                                 description=__doc__.split("\n")[0])
    from cpu_quant.models.shapes import SHAPES

    ap.add_argument("--model", choices=("synthetic", "demo", *SHAPES), default="synthetic",
                    help="a public model's name: its random-weight model of the same shapes "
                         "(cpu_quant.models.shapes), with the gptq command's default build")
    ap.add_argument("--build", choices=("default", "plain"), default=None,
                    help="with --model demo: the fidelity suite's build (default: default)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--layers", type=int, default=None,
                    help="with a public model's name: keep its first N decoder layers")
    ap.add_argument("--samples", type=int, default=None,
                    help=f"default: {REAL['samples']} (synthetic), {DEMO_SAMPLES} (demo)")
    ap.add_argument("--seqlen", type=int, default=REAL["seqlen"])
    ap.add_argument("--batch-size", type=int, default=REAL["batch_size"])
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the synthetic model and the artifact go (default: "
                         "$XDG_CACHE_HOME/cpu-quant/bench-work/memory-trace)")
    ap.add_argument("--json", type=Path, required=True, help="where the trace goes")
    ap.add_argument("--smoke", action="store_true", help="the synthetic model's smoke shapes")
    args = ap.parse_args(argv)
    if args.build is not None and args.model != "demo":
        ap.error("--build applies to --model demo only")
    if args.samples is None:
        args.samples = DEMO_SAMPLES if args.model == "demo" else REAL["samples"]
    shaped = args.model not in ("synthetic", "demo")
    if args.layers is not None and not (shaped and 1 <= args.layers <= SHAPES[args.model].layers):
        ap.error("--layers applies to a public model's name, from 1 to its number of layers")
    for name in ("depth", "samples", "seqlen", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.interval <= 10:
        ap.error("--interval must be in (0, 10] seconds")

    from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint

    if args.workdir is None:
        args.workdir = gptqmodel_env.cache_root() / "bench-work" / "memory-trace"
    settings = QuantSettings(group_size=REAL["group"], samples=args.samples, seqlen=args.seqlen,
                             batch_size=args.batch_size)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.model == "demo":
        from cpu_quant.models.demo import demo_model_path

        args.build = args.build or "default"
        src, label = demo_model_path(), f"demo-{args.build}"
        settings = replace(settings, **DEMO_BUILDS[args.build])
        layers = REAL["base_layers"]
    elif shaped:
        from cpu_quant.models.shapes import random_model_path, write_random_model

        if args.layers is None or args.layers == SHAPES[args.model].layers:
            src, label = random_model_path(args.model, progress=False), f"{args.model}-default"
        else:
            from cpu_quant.models.demo import demo_model_path

            label = f"{args.model}-{args.layers}-layers-default"
            src = args.workdir / "inputs" / label
            if not (src / "config.json").is_file():
                write_random_model(replace(SHAPES[args.model], layers=args.layers), src,
                                   demo_model_path(), progress=False)
        settings = replace(QuantSettings(samples=args.samples, seqlen=args.seqlen,
                                         batch_size=args.batch_size), smooth=None)
        layers = args.layers or SHAPES[args.model].layers
    else:
        layers = REAL["base_layers"] * args.depth
        shapes = "smoke" if args.smoke else "demo"
        src = synthetic_model(args.workdir / "inputs" / f"{shapes}-depth-{args.depth}x", layers,
                              smoke=args.smoke)
        label = f"{args.depth}x"
    dst = args.workdir / f"trace-{label}"
    with Tracer(args.interval) as tracer:
        report = quantize_checkpoint(src, dst, settings, overwrite=True,
                                     progress=False, on_layer=tracer.on_layer)
    result = {
        "kind": "diagnostic trace of one run", "label": label,
        "what": "RssAnon of this process every interval; at each new maximum (rising >= 4 MiB) the "
                "Python stacks of all threads and glibc mallinfo2; RssAnon and mallinfo2 after "
                "every layer",
        "command": " ".join(sys.argv),
        "source": str(src), "layers": layers, "settings": asdict(settings),
        "interval_s": args.interval,
        "total_seconds": report.total_seconds,
        "malloc_mmap_threshold": report.provenance.get("malloc_mmap_threshold"),
        "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "peak_rss_anon_mib": tracer.peak >> 20,
        "peaks": tracer.peaks, "layers_after": tracer.layers, "rss_anon_mib_series": tracer.series,
        # the machine, the commit and the packages: a trace run outside the suite is citable
        "provenance": collect_provenance({k: str(v) if isinstance(v, Path) else v
                                          for k, v in vars(args).items()}),
    }
    path = args.json
    path.write_text(json.dumps(result, indent=1) + "\n")
    last = tracer.peaks[-1]
    print(f"{path}: peak RssAnon {tracer.peak >> 20} MiB at {last['t']} s; MainThread at the peak:")
    print("\n".join("  " + f for f in last["stacks"].get("MainThread", [])))
    print(f"  malloc: {last['malloc']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
