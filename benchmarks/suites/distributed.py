"""Suite ``distributed``: data-parallel GPTQ, 2 ranks x 1 thread against 1 rank x 1 thread.

Arms (interleaved by the harness, each pass a fresh process tree; the demo model, head
quantized as by default, 128 x 512 calibration tokens of the built-in corpus, batch 8):

``1-rank``   ``cpu-quant gptq SRC DST --threads 1 --samples 128 --seqlen 512 --batch-size 8
             --calib austen --group 128 --no-eval --overwrite``
``2-ranks``  the same with ``--nproc 2``: two ranks on this host (torch's elastic launcher,
             gloo over loopback), one torch thread each

The baseline is ``1-rank``; the wall-time ratio is taken per pass (the issue's target: at most
0.6). Metrics: wall and CPU seconds of the whole command (start-up, tokenization and writing
included) and peak RssAnon over the process tree. ``collect`` checks that the knobs reached the
run (rule 4): the calibration tokens, the world size and each rank's thread count in the
quantization report.

Extras, from the run's ``quantization_report.json``: the tool's total seconds, its layer and
head seconds, its phase seconds (GPTQ sweeps, Hessian products), and for the two ranks each
rank's seconds, time inside collectives (waiting included) and bytes received and sent, per
decoder layer and for the head; plus ``tensors_sha256``, one digest over every tensor of the
artifact (``bit_identity.tensor_digests``): equal across the arms means the same artifact.
``python -m benchmarks.dist_projection RESULT`` turns a result into the 8B projection.

Smoke mode (CI): the tiny smoke model, 4 x 64 tokens in batches of 2 (each rank needs one).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..bit_identity import tensor_digests
from ..harness import CPU_SECONDS, PEAK_RSS_ANON, WALL_SECONDS, Arm, Command, PassContext, RunRecord, Suite
from ..render import harness_block
from .quantize import (
    REAL,
    SMOKE,
    TIMEOUT_REAL,
    TIMEOUT_SMOKE,
    SuiteOptions,
    check_cpu_quant_report,
    cpu_quant_gptq_argv,
    select,
    source_model,
)

ARMS = {"1-rank": 1, "2-ranks": 2}  # arm -> processes, one torch thread each


def tensors_sha256(directory: Path) -> str:
    """One digest over every tensor of an artifact, by name (whatever its sharding)."""
    digests = tensor_digests(directory)
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def layer_traffic(dist: dict) -> dict:
    """Bytes and collective seconds per decoder layer (median over the layers) and for the
    head, for every rank."""
    import statistics

    out = []
    for rank in dist["ranks"]:
        layers = [x for x in rank["layers"] if x["layer"] != "head"]
        head = next(x for x in rank["layers"] if x["layer"] == "head")
        out.append({
            "rank": rank["rank"], "seconds": rank["seconds"],
            "collective_seconds": rank["collective_seconds"],
            "bytes_received": rank["bytes_received"], "bytes_sent": rank["bytes_sent"],
            "layer_bytes_received_median": statistics.median(x["bytes_received"] for x in layers),
            "layer_bytes_sent_median": statistics.median(x["bytes_sent"] for x in layers),
            "layer_collective_seconds_median": statistics.median(
                x["collective_seconds"] for x in layers),
            "head_bytes_received": head["bytes_received"], "head_bytes_sent": head["bytes_sent"],
            "head_collective_seconds": head["collective_seconds"]})
    return {"world_size": dist["world_size"], "ranks": out}


def check_ranks(report: dict, processes: int, threads: int) -> None:
    """The run had ``processes`` ranks of ``threads`` torch threads each (rule 4: the knobs
    reached the run), from its ``quantization_report.json``."""
    dist = report.get("distributed")
    world = dist["world_size"] if dist else 1
    if world != processes:
        raise ValueError(f"the run had {world} ranks, not {processes}")
    ran = [r["threads"] for r in dist["ranks"]] if dist else [report["provenance"].get("threads")]
    if ran != [threads] * processes:
        raise ValueError(f"the ranks ran {ran} torch threads, not {threads} each")


def rank_arm(name: str, nproc: int, src: Path, settings: dict, timeout: float) -> Arm:
    flags = ["--threads", "1"] + (["--nproc", str(nproc)] if nproc > 1 else [])

    def command(ctx: PassContext) -> Command:
        return Command(cpu_quant_gptq_argv(src, ctx.workdir / "artifact", settings, flags),
                       timeout=timeout)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        check_ranks(check_cpu_quant_report(ctx.workdir / "artifact", settings, flags), nproc, 1)
        return {}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        art = ctx.workdir / "artifact"
        report = json.loads((art / "quantization_report.json").read_text())
        out = {"tool_total_seconds": report["total_seconds"],
               "tool_head_seconds": report["head_seconds"],
               "layer_seconds_sum": round(sum(report["layer_seconds"]), 3),
               "layer_seconds": report["layer_seconds"],
               "phase_seconds": report["phase_seconds"],
               "n_layers": len(report["layer_seconds"]),
               "tensors_sha256": tensors_sha256(art)}
        if report.get("distributed"):
            out["traffic"] = layer_traffic(report["distributed"])
        return out

    return Arm(name, {"processes": nproc, "threads_per_process": 1, "flags": flags, **settings},
               command, collect, artifacts=lambda ctx: {"artifact": ctx.workdir / "artifact"},
               extras=extras)


def gptq_inputs(opts: SuiteOptions, real: dict) -> tuple[dict, float, Path]:
    """The settings (``real``, or the smoke settings in batches of 2: one batch per rank),
    the timeout and the source of a suite that runs ``cpu-quant gptq`` as one or more ranks."""
    settings = dict(SMOKE if opts.smoke else real)
    if opts.smoke:
        settings["batch_size"] = 2  # 2 batches: one per rank
    return settings, TIMEOUT_SMOKE if opts.smoke else TIMEOUT_REAL, source_model(opts)


def build(opts: SuiteOptions) -> Suite:
    settings, timeout, src = gptq_inputs(opts, REAL)
    arms = select([rank_arm(name, n, src, settings, timeout) for name, n in ARMS.items()],
                  opts.arms)
    return Suite(
        name="distributed",
        description="Data-parallel GPTQ over torch.distributed (gloo, loopback): 2 ranks x 1 "
                    "thread against 1 rank x 1 thread, "
                    f"{'a tiny random Llama (smoke)' if opts.smoke else 'the demo model'}, "
                    "head quantized",
        metrics=[WALL_SECONDS, CPU_SECONDS, PEAK_RSS_ANON],
        arms=arms,
        settings={"source": str(src), **settings, "head": "quantized (default)"},
        baseline="1-rank" if any(a.name == "1-rank" for a in arms) else None,
        inputs={"source_model": src},
        notes=["Both arms write the same artifact: compare their extras' tensors_sha256.",
               "collective seconds include the time a rank waits for the other inside a "
               "collective (imbalance), not only transfer time."],
    )


def _digests(arm: str, doc: dict) -> str:
    digests = sorted({r["extras"].get("tensors_sha256", "")[:8] for r in doc["records"]
                      if r["arm"] == arm and r.get("ok")})
    return ", ".join(f"`{d}…`" for d in digests) or "—"


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table, with each arm's artifact
    digests (one digest per arm, the same in both arms: the same artifact)."""
    import json

    from ..render import newest

    block = harness_block(results, docs, "distributed", "python -m benchmarks run distributed",
                          {"tensor digest": _digests})
    path = newest(results, "distributed-2*.json", complete=True)
    if path is None:
        return block
    return "\n".join([block, "", "Where the time goes (medians of each pass's timers):", "",
                      phase_table(json.loads(path.read_text()))])


# where the time goes: phase -> seconds of one pass's record (the report's timers)
PHASES = (
    ("Hessian products", lambda r: r["extras"]["phase_seconds"]["hessians"]),
    ("forward passes (the layers' rest)", lambda r: r["extras"]["layer_seconds_sum"]
     - r["extras"]["phase_seconds"]["hessians"] - r["extras"]["phase_seconds"]["quantize"]),
    ("GPTQ sweeps", lambda r: r["extras"]["phase_seconds"]["quantize"]),
    ("head", lambda r: r["extras"]["tool_head_seconds"]),
    ("smoothing pass, tokenization, writing", lambda r: r["extras"]["tool_total_seconds"]
     - r["extras"]["layer_seconds_sum"] - r["extras"]["tool_head_seconds"]),
)


def phase_table(doc: dict) -> str:
    """Each phase's median seconds per arm (the tool's own timers, rank 0's), and the second
    arm's over the first's."""
    import statistics

    arms = list(doc["summary"])
    ok = {a: [r for r in doc["records"] if r["arm"] == a and r["ok"]] for a in arms}
    lines = ["| phase | " + " | ".join(f"`{a}`" for a in arms) + " | ratio |",
             "|---|" + "---|" * (len(arms) + 1)]
    for title, seconds in PHASES:
        med = [statistics.median(seconds(r) for r in ok[a]) for a in arms]
        lines.append(f"| {title} | " + " | ".join(f"{m:.1f} s" for m in med)
                     + f" | ×{med[-1] / med[0]:.2f} |")
    return "\n".join(lines)
