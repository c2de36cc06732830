"""Suite ``determinism``: is ``cpu-quant gptq``'s artifact the same bytes whatever the thread
count, the number of ranks and the CPU class?

One command (the demo model, every default but the calibration: 32 x 512 tokens of the
built-in corpus, so that nine arms fit a session), run as:

``threads-1``       ``--threads 1`` (the baseline)
``threads-2``       ``--threads 2``
``threads-3``       ``--threads 3`` (more threads than this 2-core machine has)
``ranks-2``         ``--nproc 2 --threads 1``: two ranks of one thread each
``isa-avx512``      oneDNN held to AVX-512 without its bf16 instructions
                    (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``): the kernels of an AVX-512 CPU
                    without bf16
``isa-avx2``        oneDNN, ATen and oneMKL held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``,
                    ``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``): an AVX2
                    CPU's kernels; oneDNN then reports no native bf16, so the run computes in
                    float32, as an AVX2-only CPU does
``fp32``            ``CPU_QUANT_COMPUTE_DTYPE=fp32``: the float32 forward an AVX2-only CPU
                    chooses, with this CPU's kernels
``fp32-isa-avx2``   that float32 forward on the AVX2 kernels: an AVX2-only CPU as it runs
``fp32-threads-2``  the float32 forward at ``--threads 2``

An AMX CPU cannot be emulated on a CPU without AMX (an ISA limit only takes instructions
away), so ``isa-*`` arms say nothing about AMX.

Extras, per pass: ``tensors_sha256`` (one digest over every tensor by name, as the
``distributed`` suite's), the digest of each module's tensors (``module_sha256``: which modules
differ, and from which layer on), and the report's compute dtype and threads. The page's table
(:func:`table`) compares every arm with the reference of its compute dtype in the same pass
(``threads-1`` for bf16, ``fp32`` for float32), and every pass with the first (the same arm
run again).

Smoke mode (CI): the tiny smoke model, 4 x 64 tokens, the arms ``threads-1``, ``threads-2``
and ``isa-avx2``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..bit_identity import tensor_digests
from ..harness import WALL_SECONDS, Arm, Command, PassContext, RunRecord, Suite
from .distributed import check_ranks, gptq_inputs
from .quantize import (
    SuiteOptions,
    check_cpu_quant_report,
    cpu_quant_gptq_argv,
    select,
)

REAL = {"samples": 32, "seqlen": 512, "group": 128, "batch_size": 8, "calib": "austen"}
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
FP32 = {"CPU_QUANT_COMPUTE_DTYPE": "fp32"}
# arm -> (threads per process, processes, environment)
ARMS: dict[str, tuple[int, int, dict[str, str]]] = {
    "threads-1": (1, 1, {}),
    "threads-2": (2, 1, {}),
    "threads-3": (3, 1, {}),
    "ranks-2": (1, 2, {}),
    "isa-avx512": (1, 1, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}),
    "isa-avx2": (1, 1, AVX2),
    "fp32": (1, 1, FP32),
    "fp32-isa-avx2": (1, 1, {**FP32, **AVX2}),
    "fp32-threads-2": (2, 1, FP32),
}
SMOKE_ARMS = ("threads-1", "threads-2", "isa-avx2")
BASELINE = "threads-1"
# compute dtype (the report's) -> the arm each arm of that dtype is compared with
REFERENCE = {"bfloat16": "threads-1", "float32": "fp32"}


def module_of(tensor: str) -> str:
    """``model.layers.3.mlp.down_proj.qweight`` -> ``model.layers.3.mlp.down_proj``."""
    return tensor.rsplit(".", 1)[0] if "." in tensor else tensor


def digests(directory: Path) -> tuple[str, dict[str, str]]:
    """One digest over every tensor, and one per module."""
    per_tensor = tensor_digests(directory)
    modules: dict[str, dict[str, str]] = {}
    for name, d in per_tensor.items():
        modules.setdefault(module_of(name), {})[name] = d
    whole = hashlib.sha256(json.dumps(per_tensor, sort_keys=True).encode()).hexdigest()
    return whole, {m: hashlib.sha256(json.dumps(t, sort_keys=True).encode()).hexdigest()[:16]
                   for m, t in sorted(modules.items())}


def arm(name: str, src: Path, settings: dict, timeout: float) -> Arm:
    threads, procs, env = ARMS[name]
    flags = ["--threads", str(threads)] + (["--nproc", str(procs)] if procs > 1 else [])

    def command(ctx: PassContext) -> Command:
        return Command(cpu_quant_gptq_argv(src, ctx.workdir / "artifact", settings, flags),
                       env=dict(env), timeout=timeout)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        report = check_cpu_quant_report(ctx.workdir / "artifact", settings, flags)
        check_ranks(report, procs, threads)
        want = "float32" if env.get("CPU_QUANT_COMPUTE_DTYPE") == "fp32" else None
        got = report["provenance"].get("compute_dtype")
        if want and got != want:
            raise ValueError(f"the run computed in {got}, not {want}")
        return {}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        art = ctx.workdir / "artifact"
        report = json.loads((art / "quantization_report.json").read_text())
        whole, modules = digests(art)
        return {"tensors_sha256": whole, "module_sha256": modules,
                "compute_dtype": report["provenance"].get("compute_dtype"),
                "environment": env}

    return Arm(name, {"threads": threads, "processes": procs, "environment": env,
                      "flags": flags, **settings},
               command, collect, extras=extras)


def build(opts: SuiteOptions) -> Suite:
    settings, timeout, src = gptq_inputs(opts, REAL)
    names = [n for n in ARMS if not opts.smoke or n in SMOKE_ARMS or opts.arms]
    arms = select([arm(n, src, settings, timeout) for n in names], opts.arms)
    return Suite(
        name="determinism",
        description="Bit identity of cpu-quant gptq's artifact across thread counts, ranks, "
                    "ISA limits and the compute dtype, "
                    f"{'a tiny random Llama (smoke)' if opts.smoke else 'the demo model'}",
        metrics=[WALL_SECONDS],
        arms=arms,
        settings={"source": str(src), **settings, "head": "quantized (default)"},
        baseline=BASELINE if any(a.name == BASELINE for a in arms) else None,
        inputs={"source_model": src},
        notes=["Compare each arm's tensors_sha256 with its compute dtype's reference arm's "
               "(threads-1 for bf16, fp32 for float32) of the same pass; "
               "module_sha256 names the modules that differ.",
               "An ISA limit only takes instructions away: AMX cannot be emulated here."],
    )


# -- the page's table -------------------------------------------------------------------------
def layer_key(module: str) -> tuple[int, str]:
    parts = module.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1]), module
    return 10**6, module


def compare_records(result: dict) -> list[dict]:
    """Each arm of each pass against the reference of its compute dtype in the same pass
    (``threads-1`` for bf16, ``fp32`` for float32: :data:`REFERENCE`): identical or not, how
    many modules differ and the first of them (by layer)."""
    rows = []
    by_pass: dict[int, dict[str, dict]] = {}
    for r in result["records"]:
        if r["ok"]:
            by_pass.setdefault(r["pass_index"], {})[r["arm"]] = r["extras"]
    first_pass = {}
    for p in sorted(by_pass):
        for name, ex in by_pass[p].items():
            first_pass.setdefault(name, ex)
    for p in sorted(by_pass):
        for name, ex in by_pass[p].items():
            dtype = ex.get("compute_dtype")
            ref_name = REFERENCE.get(dtype)
            row = {"arm": name, "pass": p, "compute_dtype": dtype, "reference": ref_name}
            base = by_pass[p].get(ref_name)
            if base is not None:
                diff = sorted((m for m in ex["module_sha256"]
                               if ex["module_sha256"][m] != base["module_sha256"].get(m)),
                              key=layer_key)
                row.update(identical=ex["tensors_sha256"] == base["tensors_sha256"],
                           modules=len(ex["module_sha256"]), differing=len(diff),
                           first_differing=diff[0] if diff else None)
            row["same_as_first_pass"] = ex["tensors_sha256"] == first_pass[name]["tensors_sha256"]
            rows.append(row)
    return rows


def again(rows: list[dict]) -> str:
    if len(rows) < 2:
        return "one pass"
    return "yes" if all(r["same_as_first_pass"] for r in rows) else "no"


def table(result: dict) -> str:
    """The results page's table: one row per arm, over every pass."""
    rows = compare_records(result)
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    lines = ["| arm | compute dtype | passes | compared with | same bytes | modules differing "
             "(first) | same bytes every pass |", "|---|---|---|---|---|---|---|"]
    for name in arms:
        mine = [r for r in rows if r["arm"] == name]
        same = sum(1 for r in mine if r.get("identical"))
        differing = sorted({(r["differing"], r["first_differing"]) for r in mine
                            if r.get("differing")}, key=lambda t: t[0])
        diff_text = "; ".join(f"{n} of {mine[0]['modules']} ({first})" for n, first in differing)
        ref = mine[0]["reference"]
        if ref == name:
            same_text = "(the reference)"
        elif "identical" not in mine[0]:
            same_text = f"{ref} did not run"
        else:
            same_text = "yes" if same == len(mine) else f"no ({same} of {len(mine)})"
        lines.append(f"| {name} | {mine[0]['compute_dtype']} | {len(mine)} | {ref or '—'} | "
                     f"{same_text} | "
                     f"{diff_text or '0'} | "
                     f"{again(mine)} |")
    return "\n".join(lines)


def render(results: Path, docs: Path) -> str:
    """The results page's block: the table of the newest result file, with its machine and
    command."""
    import os

    from ..render import machine, newest

    path = newest(results, "determinism-2*.json")
    if path is None:
        return "Not measured yet: no result file of this suite is committed."
    doc = json.loads(path.read_text())
    meta = machine(doc)
    partial = f" ({meta['partial']})" if meta["partial"] else ""
    return "\n".join([
        table(doc), "",
        f"Machine: {meta['cpu']} ({meta['isa']}), {meta['cores']} cores; git {meta['sha'][:7]}{partial}. "
        "Command: `python -m benchmarks run determinism`. Result file: "
        f"[{path.name}]({os.path.relpath(path, docs)})."])
