"""Suite ``tinygemm``: serving a bandwidth-bound model: bf16, GPTQ, cpu_int4 and llama.cpp.

Three parts, each its own result file (``--arms`` takes part names and arm names):

``qwen05b``  (``tinygemm-qwen05b``) a random-init Qwen2 with Qwen2-0.5B's shapes, served by
             vLLM as the ``runtime`` suite serves the demo model (its arms, its pass worker
             ``benchmarks/tinygemm_bench.py one-pass``, its knob checks: the ``runtime``
             suite's docstring), plus llama.cpp's own Q4_0 and Q4_K_M of the same bf16
             checkpoint (``llama.cpp-q4_0``, ``llama.cpp-q4_k_m``: llama-cpp-python in a peer
             venv, ``benchmarks/peers/llama_cpp_env.py``, every core as threads)
``demo``     (``tinygemm-demo``) the same arms on the demo model
``kernel``   (``tinygemm-kernel``) attribution (MEASURING.md rule 9): one arm per model
             (``kernel-qwen05b``, ``kernel-demo``) whose pass times the linears of one step,
             path by path, in one process with every core
             (``tinygemm_bench.kernel_attribution``: the plugin's op, the tinygemm kernel
             alone, the dequantize path, vLLM's ``cpu_gemm_wna16`` and W4A8 kernels where they
             exist, dense bf16 and float32). Metrics: the op's time for one decode step's
             linears (``decode_linears_ms``, M = 1, the head included) and for the 512-token
             prefill's layer linears (``prefill_linears_ms``); every path's times are in the
             pass's extras.

The quantized checkpoints are built data-free (RTN, no scale search): speed only.

Smoke mode (CI): the kernel part on the quantize suite's tiny random Llama (``kernel-smoke``);
the serving parts are the ``runtime`` suite's smoke run, and their llama.cpp arms build a peer
venv, so a smoke run refuses them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .. import tinygemm_bench as tb
from ..harness import Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite
from .quantize import SuiteOptions, smoke_model
from .runtime import REAL

MODELS = ("qwen05b", "demo")
PARTS = (*MODELS, "kernel")
LLAMA_TYPES = ("q4_0", "q4_k_m")
LLAMA_ARMS = tuple(f"llama.cpp-{t}" for t in LLAMA_TYPES)
KERNEL_METRICS = [Metric("decode_linears_ms", "ms", "lower"),
                  Metric("prefill_linears_ms", "ms", "lower")]
KERNEL_TIMEOUT = 3600


def _source(model: str, workdir: Path) -> Path:
    from cpu_quant.models.demo import demo_model_path

    return demo_model_path() if model == "demo" else tb.random_qwen(workdir / "qwen05b-bf16")


def serving_part(model: str, workdir: Path, arms: list[str]) -> Suite:
    vllm_arms = [a for a in tb.ARMS if a in arms]
    llama_types = [t for t, a in zip(LLAMA_TYPES, LLAMA_ARMS, strict=True) if a in arms]
    src = _source(model, workdir)
    artifacts = tb.build_artifacts(model, workdir, vllm_arms, src)
    extra, peer = [], None
    if llama_types:
        extra, peer = tb.llama_arms(src, workdir / "gguf", llama_types, REAL["decode_tokens"])
    suite = tb.build_suite(model, artifacts, REAL["decode_tokens"], REAL["eager"],
                           extra_arms=extra)
    suite.settings["source"] = str(src)
    if peer:
        suite.settings["llama_cpp_peer"] = peer
        suite.notes.append("llama.cpp arms: the bf16 checkpoint converted by llama.cpp's "
                           "convert_hf_to_gguf.py and quantized by llama_model_quantize "
                           "(benchmarks/peers/llama_cpp_env.py); weights memory-mapped, so "
                           "RssAnon excludes them")
    return suite


def kernel_arm(model: str, src: Path) -> Arm:
    def command(ctx: PassContext) -> Command:
        return Command([sys.executable, "-m", "benchmarks.tinygemm_bench", "kernel", model,
                        str(src), str(ctx.workdir / "kernel.json")], timeout=KERNEL_TIMEOUT)

    def read(ctx: PassContext) -> dict:
        return json.loads((ctx.workdir / "kernel.json").read_text())

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        steps = read(ctx)["linears_ms_per_step"]
        return {"decode_linears_ms": steps["int4_m1"], "prefill_linears_ms": steps["int4_m512"]}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        doc = read(ctx)
        return {k: doc[k] for k in ("model", "torch_threads", "kernel_max_rows", "prefill_gemm",
                                    "linears_ms_per_step", "layer_linears_ms_per_step_by_rows",
                                    "first_rows_where_dequantize_wins", "settings")}

    return Arm(f"kernel-{model}", {"model": model, "source": str(src)}, command, collect,
               extras=extras)


def kernel_part(sources: dict[str, Path]) -> Suite:
    return Suite(name="tinygemm-kernel", description="the linears of one step, path by path "
                 "(the plugin's op, tinygemm, vLLM's kernels, dense GEMMs)",
                 metrics=KERNEL_METRICS, arms=[kernel_arm(m, s) for m, s in sources.items()],
                 settings={"models": list(sources), "threads": "all"}, baseline=None,
                 inputs={f"source_{m}": s for m, s in sources.items()})


def _wanted(opts: SuiteOptions) -> tuple[list[str], list[str]]:
    """(parts, arms) that ``--arms`` names; every part and arm when it names none of them."""
    given = opts.arms or []
    known_arms = [*tb.ARMS, *LLAMA_ARMS, *(f"kernel-{m}" for m in MODELS)]
    unknown = [a for a in given if a not in PARTS and a not in known_arms]
    if unknown:
        raise HarnessError(f"unknown part(s) or arm(s) {', '.join(unknown)}; parts: "
                           f"{', '.join(PARTS)}; arms: {', '.join(known_arms)}")
    arms_given = [a for a in given if a not in PARTS]
    # no part named: the parts that hold the named arms (every part when none is named)
    implied = {"kernel" if a.startswith("kernel-") else m for a in arms_given for m in MODELS}
    parts = [p for p in PARTS if p in given or (not set(given) & set(PARTS) and p in implied)] \
        or list(PARTS)
    arms = arms_given or [
        a for a in (*tb.ARMS, *LLAMA_ARMS) if tb.has_amx() or a not in tb.AMX_ARMS]
    return parts, arms


def build(opts: SuiteOptions) -> list[Suite]:
    if opts.source is not None or opts.prebuilt:
        raise HarnessError("tinygemm builds its own models: no --source or --artifact (the "
                           "runtime suite serves another source)")
    parts, arms = _wanted(opts)
    if opts.smoke:
        if parts != ["kernel"]:
            raise HarnessError("a smoke run of tinygemm is its kernel part (--arms kernel); the "
                               "serving parts' smoke run is the runtime suite's")
        return [kernel_part({"smoke": smoke_model(opts.workdir / "inputs")})]
    suites = [serving_part(m, opts.workdir, arms) for m in MODELS if m in parts]
    if "kernel" in parts:
        named = [m for m in MODELS if f"kernel-{m}" in arms]  # else every model's
        sources = {m: _source(m, opts.workdir) for m in named or MODELS}
        suites.append(kernel_part(sources))
    return suites


# -- the results page ------------------------------------------------------------------------
PATHS = (("vLLM's bf16 GEMM (oneDNN, prepacked)", "onednn_bf16"),
         ("vLLM's W4A8 `int4_scaled_mm_cpu`", "w4a8"),
         ("vLLM's W4A16 `cpu_gemm_wna16`", "wna16"),
         ("the plugin's op (tinygemm kernel, dequantize + bf16 GEMM above its rows)", "int4"),
         ("… of which the dequantization (one-row product)", "dequantize_only"),
         ("the tinygemm kernel alone", "kernel"),
         ("dense bf16 `F.linear`", "bf16"))


def kernel_results(doc: dict) -> list[dict]:
    """Each model's attribution in a kernel result file: the harness suite's (one pass's
    extras per arm, the first that succeeded) or the earlier script's (``results``)."""
    if "results" in doc:
        return doc["results"]
    first = {}
    for r in doc["records"]:
        if r["ok"]:
            first.setdefault(r["arm"], r["extras"])
    return list(first.values())


def kernel_table(doc: dict) -> str:
    """Milliseconds for one step's linears, per path: at M = 1 (a decode step, the head
    included) and M = 512 (the prefill's layer linears)."""
    results = kernel_results(doc)
    head = ["path", *(f"{r['model']}: M = {m}" for r in results for m in (1, 512))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for title, key in PATHS:
        cells = [r["linears_ms_per_step"].get(f"{key}_m{m}") for r in results for m in (1, 512)]
        if all(c is None for c in cells):
            continue
        lines.append(f"| {title} | " + " | ".join("" if c is None else f"{c:.1f} ms"
                                                 for c in cells) + " |")
    wins = [f"{r['model']}: {r['first_rows_where_dequantize_wins']} rows"
            for r in results if r.get("first_rows_where_dequantize_wins")]
    if wins:
        lines += ["", "The dequantize path first beats the kernel at " + ", ".join(wins) + "."]
    return "\n".join(lines)


def kernel_block(results: Path, docs: Path) -> str:
    """The newest kernel result file of each CPU class."""
    from ..render import _cpu, isa, machine

    seen, parts = set(), []
    for path in sorted(results.glob("tinygemm-kernel-2*.json"), reverse=True):
        if "partial" in path.name:
            continue
        doc = json.loads(path.read_text())
        cls = isa(_cpu(doc))
        if cls in seen:
            continue
        seen.add(cls)
        meta = machine(doc)
        threads = doc["provenance"]["settings"].get("threads", "all")
        parts += [kernel_table(doc), "",
                  f"Machine: {meta['cpu']} ({meta['isa']}), {meta['cores']} cores, torch "
                  f"threads: {threads}; git {meta['sha'][:7]}. Command: `python -m benchmarks "
                  f"run tinygemm --arms kernel`. Result file: "
                  f"[{path.name}]({os.path.relpath(path, docs)}).", ""]
    return "\n".join(parts[:-1]) if parts else "Not measured yet."


def render(results: Path, docs: Path) -> str:
    """The results page's block: each model's serving table per CPU class, then the kernel
    attribution per CPU class."""
    from ..render import harness_block

    out = []
    for model, title in (("qwen05b", "The 0.5B model"), ("demo", "The demo model")):
        out += [f"**{title}** (decode: batch 1, 64 tokens after a 16-token prompt; prefill: a "
                "512-token prompt):", "",
                harness_block(results, docs, f"tinygemm-{model}",
                              f"python -m benchmarks run tinygemm --arms {model}", per_cpu=True),
                ""]
    out += ["**Where a step's time goes** (the linears alone, median):", "",
            kernel_block(results, docs)]
    return "\n".join(out)
