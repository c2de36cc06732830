"""Suite ``scale``: the sizes users quantize, on random models of public shapes (1B, 3B, 8B).

The models come from ``cpu_quant.models.shapes`` (Llama-3.2-1B, Llama-3.2-3B and Llama-3-8B's
exact configs, random bf16 weights, the demo tokenizer): **speed and memory only**, every
fidelity number of such a model is meaningless. ``--arms`` names the models (default: all
three; ``--arms Llama-3.2-1B`` runs one), each optionally with one part (``MODEL:quantize``,
``MODEL:serve``, ``MODEL:checks``, ``MODEL:rerun``, ``MODEL:phone``; the serving, checks and
rerun parts read the quantize part's output in ``--workdir``; a bare model name runs every part
but the phone part, which only the 1B model runs by default). The parts, each its own result
file:

``scale-quantize``  per model, two interleaved arms:
    ``floor-<model>``  ``python -m benchmarks.compute_floor``: this machine's compute floor of
                       the run's phases at the run's own shapes, and the run's memory bound
                       (:func:`memory_bound`), with the RssAnon of a process that has imported
                       the pipeline and allocated nothing (the runtime floor)
    ``gptq-<model>``   ``cpu-quant gptq SRC DST --format gptq,cpu_int4,gguf`` with every default
                       setting but the calibration size (:data:`CALIBRATION`), into one
                       directory per model that the serving part reads; wall time, peak RssAnon
                       of the process tree, and in the extras the report's exclusive time per
                       phase (``cpu_quant/quantize/clock.py``)
``scale-serve-<model>``  the tinygemm benchmark's vLLM arms on that artifact: ``bf16`` (the
    random source), ``gptq`` (the GPTQ output, the kernel this CPU's row of the kernel table
    names) and ``cpu_int4`` (the tinygemm output): decode (batch 1) and 512-token prefill
    tokens/s and RssAnon after start-up, attributed per process and, in the worker, to weights
    and KV cache.
``scale-checks-<model>``, ``scale-rerun-<model>``  ``benchmarks/scale_checks.py`` on that
    artifact (verify, inspect, convert, eval; a killed-and-resumed run and a two-process run,
    each compared bit for bit).
``scale-phone-<model>``  the phone suite's ``8da4w-head8`` arm (ExecuTorch's Llama-3.2 recipe:
    4-bit GPTQ codes in groups of 32 with int8 dynamic activations, int8 embedding, 8-bit
    head), with the GPTQ run on this suite's calibration size: the export's wall time and peak
    RssAnon (one build), the program's size, and its decode and prefill through ExecuTorch's
    runtime. Its source is the model's *peaked* variant (``cpu_quant.models.shapes``: the
    embedding at unit variance, the same shapes and compute), because the export refuses to
    write a program whose top-1 tokens disagree with the float model's, and the plain random
    model's flat next-token distribution makes that agreement noise; on the peaked variant
    the check passes trivially, so this part measures speed and memory only.

Smoke mode (CI): the quantize suite's tiny random Llama in place of every model, 4 x 64
calibration tokens, one pass, no serving part; its numbers say nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..harness import PEAK_RSS_ANON, WALL_SECONDS, Arm, Command, PassContext, RunRecord, Suite
from ..render import machine, newest
from .quantize import CLI, SuiteOptions, check_cpu_quant_report, smoke_model

MODELS = ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3-8B")
# (samples, seqlen) per model: shorter than the default 128 x 512 so that a session holds three
# interleaved passes; the forward's, the Hessians' and the smoothing pass's time scale with the
# tokens, the sweeps' and the writing's do not (each phase is judged against its own floor,
# measured at these shapes); the 8B run takes half the 3B's tokens so that its pass fits a
# session on 2 cores (its forward, Hessian and smoothing floors are measured at 4 x 512)
CALIBRATION = {"Llama-3.2-1B": (16, 512), "Llama-3.2-3B": (8, 512), "Llama-3-8B": (4, 512)}
SMOKE_CALIBRATION = (4, 64)
BATCH = 8
FORMATS = "gptq,cpu_int4,gguf"
TIMEOUT = 6 * 3600


# float32 K x K matrices held at the peak of one group's quantization, for the widest input K:
# the Hessian (its sum scaled in place), and while it is factored its reversed copy with the
# factorization's working copy; once that copy is dropped, the factor with the inverse being
# built and three quarter-size products (``gptq.prepare_hessian``, ``factor.invert_lower``)
HESSIAN_COPIES = 3.75


def memory_bound(config: dict, samples: int, seqlen: int, batch: int, runtime_floor: int) -> dict:
    """The peak RssAnon a run should stay under: the runtime floor, plus the largest of (one
    decoder layer's work, the head's work), plus the calibration activations. Every term in
    bytes, from the config and the calibration alone:

    - a layer: its weights in the compute dtype (bf16, 2 B), the float32 working copy of its
      largest linear twice (the weight being swept and its column-permuted copy), and the
      Hessian of its widest input with what factoring it holds: :data:`HESSIAN_COPIES` float32
      ``K x K`` matrices (the linears are quantized group by group, one Hessian at a time);
    - the head: its bf16 weight, its float32 working copy twice, its float32 Hessian and
      inverse;
    - activations: the calibration slab (``tokens x hidden``, bf16), the true-sequential stores
      of a layer (``tokens x (hidden + intermediate)``, bf16), and one batch's float32
      temporaries of the MLP (three ``rows x intermediate``).
    """
    cfg = config.get("text_config") or config
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(cfg["vocab_size"])
    linears = [(heads * hd, hidden), (kv * hd, hidden), (kv * hd, hidden), (hidden, heads * hd),
               (inter, hidden), (inter, hidden), (hidden, inter)]
    widths = [hidden, heads * hd, hidden, inter]  # distinct inputs: qkv, o, gate/up, down
    largest = max(n * k for n, k in linears)
    layer = int(2 * sum(n * k for n, k in linears) + 2 * 4 * largest
                + HESSIAN_COPIES * 4 * max(widths) ** 2)
    head = 2 * vocab * hidden + 2 * 4 * vocab * hidden + 2 * 4 * hidden * hidden
    tokens = samples * seqlen
    activations = 2 * tokens * hidden + 2 * tokens * (hidden + inter) + 3 * 4 * batch * seqlen * inter
    terms = {"runtime_floor": runtime_floor, "layer": layer, "head": head,
             "activations": activations}
    return {"terms": terms, "bound_bytes": runtime_floor + max(layer, head) + activations,
            "formula": "runtime_floor + max(layer, head) + activations"}


def _argv_value(argv: list[str], flag: str) -> int:
    return int(argv[argv.index(flag) + 1])


def current_bound(model: str, floor_record: dict) -> int:
    """:func:`memory_bound` as this revision states it, for a floor arm's model and settings
    (its argv) and its measured runtime floor: a result file's own bound is the formula of
    its revision, so a table of several files takes every bound from the one formula. The
    config is the run's source's where it is on this machine (the smoke run's tiny model),
    else the named model's published one (what the random model was written with)."""
    from cpu_quant.models.shapes import SHAPES

    argv = floor_record["argv"]
    source = Path(argv[argv.index("benchmarks.compute_floor") + 1]) / "config.json"
    config = json.loads(source.read_text()) if source.is_file() else SHAPES[model].config()
    return memory_bound(config, _argv_value(argv, "--samples"),
                        _argv_value(argv, "--seqlen"), _argv_value(argv, "--batch-size"),
                        floor_record["extras"]["runtime_floor_bytes"])["bound_bytes"]


def _floor_arm(model: str, src: Path, samples: int, seqlen: int, dst: Path) -> Arm:
    def command(ctx: PassContext) -> Command:
        return Command([sys.executable, "-m", "benchmarks.compute_floor", str(src),
                        "--samples", str(samples), "--seqlen", str(seqlen),
                        "--batch-size", str(BATCH), "--out", str(ctx.workdir / "floor.json")],
                       timeout=3600)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        return {}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        floor = json.loads((ctx.workdir / "floor.json").read_text())
        config = json.loads((src / "config.json").read_text())
        floor["memory"] = memory_bound(config, samples, seqlen, BATCH, floor["runtime_floor_bytes"])
        return floor

    return Arm(f"floor-{model}", {"model": model, "source": str(src), "samples": samples,
                                  "seqlen": seqlen, "batch_size": BATCH}, command, collect,
               artifacts=lambda ctx: {"floor": ctx.workdir / "floor.json"}, extras=extras)


def _gptq_arm(model: str, src: Path, samples: int, seqlen: int, dst: Path) -> Arm:
    settings = {"samples": samples, "seqlen": seqlen, "group": 128, "batch_size": BATCH,
                "calib": "austen"}
    argv = [*CLI, "gptq", str(src), str(dst), "--samples", str(samples), "--seqlen", str(seqlen),
            "--batch-size", str(BATCH), "--format", FORMATS, "--no-eval", "--overwrite"]

    def command(ctx: PassContext) -> Command:
        return Command(argv, timeout=TIMEOUT)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        check_cpu_quant_report(dst / "gptq", settings, [])
        return {}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        report = json.loads((dst / "gptq" / "quantization_report.json").read_text())
        sizes = {p.name: p.stat().st_size for p in dst.rglob("*") if p.is_file()}
        return {"phase_seconds": report["phase_seconds"], "total_seconds": report["total_seconds"],
                "layer_seconds": report["layer_seconds"], "head_seconds": report["head_seconds"],
                "calibration_tokens": report["calibration_tokens"],
                "bits_per_weight": report["bits_per_weight"],
                "artifact_bytes": sum(sizes.values()),
                "smoothing": {k: v for k, v in (report.get("smoothing") or {}).items()
                              if k != "folds"}}

    return Arm(f"gptq-{model}", {"model": model, "source": str(src), "formats": FORMATS,
                                 **settings}, command, collect,
               artifacts=lambda ctx: {f: dst / f for f in FORMATS.split(",")}, extras=extras)


PARTS = ("quantize", "serve", "checks", "rerun", "phone")
PHONE_MODELS = ("Llama-3.2-1B",)  # the models whose bare name includes the phone part
PHONE_ARM = "8da4w-head8"
# the rerun part's kill point: the end of this layer (a third of the way through the smallest)
RESUME_AT = 5


def _checks_arm(model: str, src: Path, samples: int, seqlen: int, dst: Path, rerun: bool) -> Arm:
    """``benchmarks/scale_checks.py`` on the quantize part's artifact: verify, inspect, convert
    and eval (``checks``), or a killed-and-resumed run and a two-process run, each compared
    with the artifact bit for bit (``rerun``)."""
    argv = [sys.executable, "-m", "benchmarks.scale_checks", str(src), str(dst),
            "--samples", str(samples), "--seqlen", str(seqlen), "--batch-size", str(BATCH)]
    argv += ["--only-rerun", "--resume-at", str(RESUME_AT), "--nproc"] if rerun else []

    def command(ctx: PassContext) -> Command:
        return Command([*argv, "--json", str(ctx.workdir / "checks.json")], timeout=TIMEOUT)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        return {}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        doc = json.loads((ctx.workdir / "checks.json").read_text())
        return {"steps": [{k: v for k, v in step.items() if not k.endswith("_tail")}
                          for step in doc["steps"]], "ok": doc["ok"]}

    part = "rerun" if rerun else "checks"
    return Arm(f"{part}-{model}", {"model": model, "source": str(src), "samples": samples,
                                   "seqlen": seqlen, "batch_size": BATCH, "part": part},
               command, collect, extras=extras)


def _selection(opts: SuiteOptions) -> dict[str, tuple[str, ...]]:
    """model -> the parts to run, from ``--arms`` (``MODEL`` or ``MODEL:PART``)."""
    chosen: dict[str, tuple[str, ...]] = {}
    for entry in opts.arms or MODELS:
        model, _, part = entry.partition(":")
        if model not in MODELS or (part and part not in PARTS):
            raise ValueError(f"unknown arm {entry!r}; --arms takes MODEL or MODEL:PART with MODEL "
                             f"one of {', '.join(MODELS)} and PART one of {', '.join(PARTS)}")
        every = tuple(p for p in PARTS if p != "phone" or model in PHONE_MODELS)
        chosen[model] = tuple(dict.fromkeys(chosen.get(model, ()) + ((part,) if part else every)))
    return chosen


def build(opts: SuiteOptions) -> list[Suite]:
    from cpu_quant.models.shapes import random_model_path

    from .. import tinygemm_bench as tb

    selection = _selection(opts)
    models = list(selection)
    for model, parts in selection.items():  # before any model is written or read
        for part in (p for p in parts if p not in ("quantize", "phone")):
            out = opts.workdir / "artifacts" / model
            if "quantize" not in parts and not (out / "gptq").is_dir() and not opts.smoke:
                raise ValueError(f"{model}:{part} needs the quantize part's output in {out}: "
                                 f"run {model}:quantize with this --workdir first")
    arms: list[Arm] = []
    sources: dict[str, Path] = {}
    outputs: dict[str, Path] = {}
    for model in (m for m in models if set(selection[m]) - {"phone"}):  # the plain model's parts
        if opts.smoke:
            from ..peers import gptqmodel_env

            src, (samples, seqlen) = smoke_model(gptqmodel_env.cache_root()), SMOKE_CALIBRATION
        else:
            src, (samples, seqlen) = random_model_path(model), CALIBRATION[model]
        dst = opts.workdir / "artifacts" / model
        dst.parent.mkdir(parents=True, exist_ok=True)
        sources[model], outputs[model] = src, dst
        if "quantize" in selection[model]:
            arms += [_floor_arm(model, src, samples, seqlen, dst),
                     _gptq_arm(model, src, samples, seqlen, dst)]
    quantized = [m for m in models if "quantize" in selection[m]]
    quantize = Suite(
        name="scale-quantize",
        description=("cpu-quant gptq at the sizes users quantize (random models of public "
                     "shapes: speed and memory only), against this machine's compute floor"
                     + (" (SMOKE)" if opts.smoke else "")),
        metrics=[WALL_SECONDS, PEAK_RSS_ANON], arms=arms,
        baseline_of={a.name: a.name for a in arms},
        settings={"models": quantized,
                  "calibration": {m: SMOKE_CALIBRATION if opts.smoke else CALIBRATION[m]
                                  for m in quantized},
                  "batch_size": BATCH, "formats": FORMATS},
        inputs={f"source-{m}": sources[m] for m in quantized},
        notes=["random weights (cpu_quant.models.shapes): fidelity is not measured",
               "the floor arm and the quantization arm run in the same pass, one after the other"])
    if opts.smoke:
        return [quantize]
    checks = []
    for model in models:
        for part in ("checks", "rerun"):
            if part not in selection[model]:
                continue
            samples, seqlen = CALIBRATION[model]
            arm = _checks_arm(model, sources[model], samples, seqlen, outputs[model],
                              rerun=part == "rerun")
            checks.append(Suite(
                name=f"scale-{part}-{model}",
                description=("verify, inspect, convert and eval" if part == "checks" else
                             "a killed-and-resumed run and a two-process run") +
                            " at this size, against the quantize part's artifact",
                metrics=[WALL_SECONDS, PEAK_RSS_ANON], arms=[arm],
                baseline_of={arm.name: arm.name},
                settings={"model": model, "calibration": [samples, seqlen], "batch_size": BATCH,
                          "resume_at_layer": RESUME_AT if part == "rerun" else None},
                inputs={f"source-{model}": sources[model]},
                notes=["random weights (cpu_quant.models.shapes): fidelity is not measured",
                       "correctness at size: each step's exit status and, where it writes an "
                       "artifact, its bits against the quantize part's"]))
    serve = []
    for model in (m for m in models if "serve" in selection[m]):
        artifacts = {"bf16": sources[model], "gptq": outputs[model] / "gptq",
                     "cpu_int4": outputs[model] / "cpu_int4"}
        suite = tb.build_suite(model, artifacts, 64, False, name=f"scale-serve-{model}")
        suite.settings["quantized_arms"] = "the scale-quantize part's artifact (default settings)"
        suite.notes.append("random weights (cpu_quant.models.shapes): speed and memory only")
        serve.append(suite)
    phone = [_phone_suite(model) for model in models if "phone" in selection[model]]
    return ([quantize] if arms else []) + serve + checks + phone


def _phone_suite(model: str) -> Suite:
    """The phone suite's :data:`PHONE_ARM` on the model's peaked variant, its GPTQ run on this
    suite's calibration size (module docstring)."""
    from cpu_quant.models.shapes import random_model_path

    from . import phone as ph

    samples, seqlen = CALIBRATION[model]
    settings = {**ph.REAL, "gptq_samples": samples, "gptq_seqlen": seqlen}
    src = random_model_path(model, peaked=True)
    arm = ph.scheme_arm(PHONE_ARM, src, settings, ph.TIMEOUT)
    return Suite(
        name=f"scale-phone-{model}",
        description=(f"export-phone at {model}'s shapes (its peaked random variant): ExecuTorch's "
                     "Llama-3.2 recipe on XNNPACK, the export's time and peak, the program's "
                     "size, decode and prefill through ExecuTorch's runtime, batch 1"),
        metrics=ph.METRICS, arms=[arm], baseline_of={arm.name: arm.name},
        settings={"model": model, "source": str(src), **settings,
                  "runtime": "ExecuTorch Python runtime (pybindings), greedy, batch 1"},
        inputs={f"source-{model}-peaked": src},
        notes=["random weights with a unit-variance embedding (cpu_quant.models.shapes, peaked): "
               "the export's verification passes trivially on it; speed and memory only",
               "export time is a one-off build measurement (result['builds'])"])


# -- the results page's table ----------------------------------------------------------------
PHASES = ("forward", "hessians", "quantize", "smoothing")


def _meta(doc: dict) -> dict:
    """The machine, git commit and models of a result file, complete or partial."""
    meta = machine(doc)
    if doc.get("complete", True):
        meta["models"] = doc["provenance"]["settings"]["models"]
    else:
        meta["models"] = [a.removeprefix("gptq-") for a in doc["arms"] if a.startswith("gptq-")]
    return meta


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def _fmt_s(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"


def _ratio(measured: float, floor: float) -> str:
    return f"×{measured / floor:.2f}" if floor > 0 else "—"  # a tiny model's floor rounds to 0


def render(results: Path, docs: Path, smoke: bool = False) -> str:
    """The scale table from the newest committed result files of the suite's parts (of its
    smoke runs with ``smoke``)."""
    import os

    kind = "smoke-" if smoke else ""
    # per model, the newest committed file that measured it (a session measures some sizes)
    files = sorted(results.glob(f"scale-quantize-{kind}2*.json"), key=lambda p: p.name,
                   reverse=True)
    if not files:
        return "Not measured yet: no result file of this suite is committed."
    docs_of = {p: json.loads(p.read_text()) for p in files}

    def measured(doc: dict, model: str) -> bool:
        return all(any(r["arm"] == f"{part}-{model}" and r["ok"] for r in doc["records"])
                   for part in ("gptq", "floor"))

    source = {m: next((p for p in files if measured(docs_of[p], m)), None) for m in MODELS}
    link = lambda p: f"[{p.name}]({os.path.relpath(p, docs)})"  # noqa: E731
    lines = ["| model (random weights) | calibration tokens | quantize: wall (passes) | "
             "× compute floor: whole run; forward, Hessians, sweeps, smoothing | "
             "peak RssAnon (bound) | "
             "vLLM decode / 512-token prefill / RssAnon × bf16 | result files |",
             "|---|---|---|---|---|---|---|"]
    from cpu_quant.models.shapes import SHAPES

    used: list[Path] = []
    for model in MODELS:
        qpath = source[model]
        if qpath is None:
            lines.append(f"| {model} ({SHAPES[model].parameters() / 1e9:.2f} B) | "
                         + " | ".join(["not measured"] * 6) + " |")
            continue
        if qpath not in used:
            used.append(qpath)
        q = docs_of[qpath]
        runs = [r for r in q["records"] if r["arm"] == f"gptq-{model}" and r["ok"]]
        floors = [r for r in q["records"] if r["arm"] == f"floor-{model}" and r["ok"]]
        wall = _median([r["wall_seconds"] for r in runs])
        peak = _median([r["metrics"]["peak_rss_anon_bytes"] for r in runs])
        phases = {p: _median([r["extras"]["phase_seconds"].get(p, 0.0) for r in runs])
                  for p in PHASES}
        floor = {p: _median([f["extras"]["phases"][p]["floor_seconds"] for f in floors])
                 for p in PHASES}
        bound = _median([current_bound(model, f) for f in floors])
        floor_total = sum(floor.values())
        tokens = runs[0]["extras"]["calibration_tokens"]
        ratios = ", ".join(_ratio(phases[p], floor[p])
                           for p in ("forward", "hessians", "quantize", "smoothing"))
        cells = [f"{model} ({SHAPES[model].parameters() / 1e9:.2f} B)", f"{tokens:,}",
                 f"{_fmt_s(wall)} ({len(runs)})", f"{_ratio(wall, floor_total)}; {ratios}",
                 f"{peak / 2**30:.2f} GiB ({bound / 2**30:.2f})"]
        spath = newest(results, f"scale-serve-{model}-{kind}2*.json")
        files = [link(qpath)]
        srv = json.loads(spath.read_text()) if spath is not None else None
        if srv is not None and srv.get("complete", True):
            comp = srv["comparisons"]
            parts = []
            for arm in ("gptq", "cpu_int4"):
                c = comp.get(arm, {})
                if c:
                    parts.append(f"{arm}: ×{c['decode_tok_s']['ratio_median']:.2f} / "
                                 f"×{c['prefill_tok_s']['ratio_median']:.2f} / "
                                 f"×{c['rss_anon_bytes']['ratio_median']:.2f}")
            cells.append("<br>".join(parts) or "—")
            files.append(link(spath))
        else:
            cells.append("not measured")
        cells.append("<br>".join(files))
        lines.append("| " + " | ".join(cells) + " |")
    for qpath in used:
        q = docs_of[qpath]
        meta = _meta(q)
        partial = f" ({meta['partial']})" if meta["partial"] else ""
        lines.append("")
        lines.append(f"{link(qpath)}: machine: {meta['cpu']} ({meta['isa']}), {meta['cores']} "
                     f"cores; git {meta['sha'][:7]}{partial}. Command: `python -m benchmarks run scale "
                     f"--arms {','.join(meta['models'])}`.")
        if q.get("machine_note"):
            lines.append(f"Note on this run: {q['machine_note']}.")
    for model in MODELS:
        for part in ("checks", "rerun"):
            path = newest(results, f"scale-{part}-{model}-{kind}2*.json")
            if path is not None:
                lines += ["", _checks_line(model, part, json.loads(path.read_text()), link(path))]
        path = newest(results, f"scale-phone-{model}-{kind}2*.json")
        if path is not None:
            lines += ["", _phone_line(model, json.loads(path.read_text()), link(path))]
    return "\n".join(lines)


def _phone_line(model: str, doc: dict, link: str) -> str:
    """One sentence per phone file: the export's time and peak, the program's size, decode
    and prefill (medians over the passes)."""
    runs = [r for r in doc["records"] if r["arm"] == PHONE_ARM and r.get("ok")]
    meta = machine(doc)
    settings = doc["settings"] if "settings" in doc else doc["provenance"]["settings"]
    head = (f"{model}, `export-phone --backend xnnpack --scheme 8da4w --group 32 --head-bits 8` "
            f"(its peaked random variant; GPTQ on {settings['gptq_samples']} x "
            f"{settings['gptq_seqlen']} tokens)")
    build = doc.get("builds", {}).get(PHONE_ARM)
    tail = (f" {meta['cpu']} ({meta['isa']}), git {meta['sha'][:7]}; "
            f"`python -m benchmarks run scale --arms {model}:phone`; {link}.")
    if build and build.get("exit_status") not in (0, None):
        killed = build["exit_status"] == -9  # SIGKILL: the kernel's out-of-memory killer here
        return (f"{head}: the export did not finish: "
                + ("killed (SIGKILL) " if killed else f"exit status {build['exit_status']} ")
                + f"after {_fmt_s(build['wall_seconds'])}, at a peak RssAnon of "
                f"{build['rss']['peak_rss_anon_bytes'] / 2**30:.2f} GiB."
                + tail + (f" Note on this run: {doc['machine_note']}."
                          if doc.get("machine_note") else ""))
    if not runs or not build:
        return f"{head}: no pass finished ({link})."
    med = {k: _median([r["metrics"][k] for r in runs])
           for k in ("decode_tok_s", "prefill_tok_s", "pte_bytes")}
    ratio = runs[0]["extras"]["pte_ratio_vs_float32_params"]
    partial = f" ({meta['partial']})" if meta["partial"] else ""
    return (f"{head}: exported in {_fmt_s(build['wall_seconds'])} at a peak RssAnon of "
            f"{build['rss']['peak_rss_anon_bytes'] / 2**30:.2f} GiB; model.pte "
            f"{med['pte_bytes'] / 1e9:.2f} GB (×{ratio:.3f} of its float32 parameters); "
            f"ExecuTorch's runtime, batch 1, {len(runs)} pass(es): decode "
            f"{med['decode_tok_s']:.1f} tok/s, {settings['prompt_tokens']}-token prefill "
            f"{med['prefill_tok_s']:.1f} tok/s. {meta['cpu']} ({meta['isa']}), git "
            f"{meta['sha'][:7]}{partial}; `python -m benchmarks run scale --arms {model}:phone`; "
            f"{link}." + (f" Note on this run: {doc['machine_note']}."
                          if doc.get("machine_note") else ""))


def _checks_line(model: str, part: str, doc: dict, link: str) -> str:
    """One sentence per checks or rerun file: each step, whether it held, its time and peak."""
    runs = [r for r in doc["records"] if r["arm"] == f"{part}-{model}" and r.get("extras")]
    if not runs:
        return f"{model}, {part}: no pass finished ({link})."
    steps = runs[0]["extras"]["steps"]
    said = "; ".join(f"{st['step']} {'held' if st['ok'] else 'FAILED'} "
                     f"({_fmt_s(st['wall_seconds'])}, {st['peak_rss_anon_bytes'] / 2**30:.2f} GiB)"
                     for st in steps)
    meta = machine(doc)
    what = ("verify, inspect, convert (against the run's cpu_int4, bit for bit), eval"
            if part == "checks" else
            "killed at a layer's end and resumed, and two processes, each against the "
            "quantize part's output, bit for bit")
    partial = f" ({meta['partial']})" if meta["partial"] else ""
    return (f"{model}, {what}: {said}. {meta['cpu']} ({meta['isa']}), git {meta['sha'][:7]}"
            f"{partial}; "
            f"`python -m benchmarks run scale --arms {model}:{part}`; {link}."
            + (f" Note on this run: {doc['machine_note']}." if doc.get("machine_note") else ""))
