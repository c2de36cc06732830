"""Suite ``fidelity_archs``: the fidelity methods of ``cpu-quant gptq`` on a tiny model of every
supported architecture, each against its own bf16 source on held-out text.

Per architecture (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3: ``TINY_ARCHS``), five arms,
the ``+head`` rows of the ``fidelity`` suite (``fidelity.ARMS``), named ``ARCH:ROW``:

=========================  =======================================================================
``gptq+head``              the default: no fidelity flags (smoothing folded in where it applies,
                           head in groups of 32); every other arm of the architecture is compared
                           with it (``baseline_of``)
``gptq+head-nosmooth``     ``--no-smooth``
``gptq+head-g128``         ``--head-group 128`` (the run's group; 128 divides hidden 256)
``gptq+head-plain``        ``--no-smooth --head-group 128 --down-group 128`` (the defaults before
                           all three)
``gptq+head-down128``      ``--down-group 128`` (the down projections in the run's group; 128
                           divides intermediate 512)
=========================  =======================================================================

Smoothing does not fold into gemma2, gemma3 or phi3 (``smooth_fold.refuse``): there the default
and ``--no-smooth`` build the same artifact (``--head-group 128`` and ``gptq+head-plain`` differ
by the down projections' group only). Those rows stay in the result; the suite's notes say
why, every pass records the artifact's ``plan_notes`` from its ``quantization_report.json``
(``extras.plan_notes``) and whether it folded (``extras.smooth``), and the artifacts' digests
in the provenance show the pair equal.

**The models** (``cpu_quant.models.tiny.make_tiny_model``, seed 0, the demo tokenizer's 49152
tokens): hidden 256, intermediate 512, 4 layers, 4 heads (head_dim 64), 2 kv heads, the head
tied or untied as the architecture's config class has it (gemma2, gemma3 tied; the others
untied). Mistral without a sliding window has Llama's layer layout, so the same seed gives it
Llama's weights: its rows repeat Llama's (the digests differ only by ``config.json``).

**Init scale**: every weight drawn with std ``1/sqrt(hidden)`` = 0.0625 (LeCun's fan-in rule:
a linear reading the hidden state maps unit-RMS inputs to unit-RMS outputs) instead of
transformers' 0.02. At 0.02 the logits have std 0.32 and the next-token entropy is 10.75 nats,
against 10.80 for uniform over 49152 tokens, so quantization barely moves the distribution; at
0.0625 the logits have std 1.0 (entropy 10.3, llama), and the default arm's held-out KL on
llama was 0.043 nats in a trial run (for scale, the demo model's logits have std 3.6). The rule
was chosen before any arm was compared and is the same for every architecture and arm. Random
weights have no outlier channels, which is what smoothing is for on trained models: these
numbers say whether a method hurts or helps on each architecture's layer layout, not how much
it helps a trained model (the ``fidelity`` suite on the demo model does).

**Sizes.** Calibration: the built-in austen corpus, 32 windows × 512 tokens, group 128 (the
demo suites' 128 × 512 costs about 19 s per artifact here, × 28 artifacts). Evaluation:
``fidelity.eval_argv`` (``cpu-quant eval ART --reference SRC ... --w4a8``) with 4 held-out
windows × 512 tokens and 4 greedy prompts × 32 tokens, not ``EVAL_REAL``'s 16 × 512 and 12
prompts: 28 arms × 3 passes of ``EVAL_REAL`` would take about 35 minutes on 2 cores; at these
sizes the whole run took 28 minutes (fidelity_archs-20261204T205049Z.json). The evaluation
is deterministic, so each arm's spread over passes is expected to be 0 and the harness'
verdict ranks any difference: read a difference against ``extras.kl_stderr``, the KL's
standard error over the 2044 scored tokens (about 1 % of the KL here). Metrics are the
``fidelity`` suite's (``kl_mean`` with bf16 activations, ``kl_mean_w4a8`` with int8-per-token
activations, top-1, greedy, perplexity delta); extras add the KL's standard error.

Smoke mode (CI): llama (folded) and gemma2 (not folded), arms ``gptq+head`` and
``gptq+head-nosmooth`` each, models of hidden 128, intermediate 256, 2 layers; calibration
4 × 64 tokens and ``fidelity.EVAL_SMOKE``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from cpu_quant.models.demo import demo_model_path
from cpu_quant.models.tiny import TINY_ARCHS, TinyShape, make_tiny_model
from cpu_quant.quantize.smooth_fold import refuse

from ..harness import Arm, PassContext, RunRecord, Suite
from . import fidelity
from . import quantize as q

SEED = 0
REAL_SHAPE = TinyShape(hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, tied=None,
                       init_std=1 / math.sqrt(256))
SMOKE_SHAPE = TinyShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, tied=None,
                        init_std=1 / math.sqrt(128))
REAL = {**q.REAL, "samples": 32}
EVAL = {"windows": 4, "seqlen": 512, "prompts": 4, "new_tokens": 32}
ROWS = ("gptq+head", "gptq+head-nosmooth", "gptq+head-g128", "gptq+head-plain",
        "gptq+head-down128")
DEFAULT = ROWS[0]
SMOKE_ARCHS = ("llama", "gemma2")
SMOKE_ROWS = ("gptq+head", "gptq+head-nosmooth")


def arm_name(arch: str, row: str) -> str:
    return f"{arch}:{row}"


def tiny_sources(archs: tuple[str, ...], shape: TinyShape, inputs: Path) -> dict[str, Path]:
    """The seeded tiny model of each architecture, built afresh under ``inputs``."""
    demo = demo_model_path()
    return {arch: make_tiny_model(arch, inputs / f"tiny-{arch}", demo, seed=SEED, shape=shape)
            for arch in archs}


def _with_report(arm: Arm) -> Arm:
    """The arm, its extras adding what the artifact's report says about smoothing and the
    plan (rule 4: the knob reached the pipeline, or the report says why not) and the KL's
    standard errors."""
    base_extras = arm.extras

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        out = dict(base_extras(ctx, run)) if base_extras else {}
        report = json.loads((ctx.build_dir / "artifact" / "quantization_report.json").read_text())
        doc = json.loads((ctx.workdir / "fidelity.json").read_text())["fidelity"]
        out.update(smooth=report["settings"].get("smooth"), plan_notes=report["plan_notes"],
                   head_group=report["settings"].get("head_group"),
                   kl_stderr=doc["weights"]["kl_stderr"],
                   kl_stderr_w4a8=doc["w4a8_emulated"]["kl_stderr"])
        return out

    arm.extras = extras
    return arm


def build(opts: q.SuiteOptions) -> Suite:
    if opts.source is not None or opts.prebuilt:
        raise ValueError("fidelity_archs builds its own tiny models: no --source or --artifact")
    settings = dict(q.SMOKE if opts.smoke else REAL)
    ev = dict(fidelity.EVAL_SMOKE if opts.smoke else EVAL)
    timeout = q.TIMEOUT_SMOKE if opts.smoke else q.TIMEOUT_REAL
    shape = SMOKE_SHAPE if opts.smoke else REAL_SHAPE
    archs = SMOKE_ARCHS if opts.smoke else tuple(TINY_ARCHS)
    rows = SMOKE_ROWS if opts.smoke else ROWS
    specs = {s.name: s for s in fidelity.ARMS}
    sources = tiny_sources(archs, shape, opts.workdir / "inputs")
    arms: list[Arm] = []
    baseline_of: dict[str, str] = {}
    notes = ["Each architecture's arms are compared with its own default (baseline_of); the "
             "models are random (seeded), so the numbers rank methods per layer layout, not "
             "their gain on trained models."]
    for arch, src in sources.items():
        why = refuse(json.loads((src / "config.json").read_text()))
        if why:
            notes.append(f"{arch}: smoothing does not apply ({why}); its gptq+head and "
                         "gptq+head-nosmooth arms build the same artifact (see their artifact "
                         "digests and extras.plan_notes)")
        for row in rows:
            spec = specs[row]
            named = type(spec)(arm_name(arch, row), f"{arch}: {spec.description}", spec.tool,
                               spec.subcommand, spec.flags)
            arm = fidelity.cpu_quant_fidelity_arm(named, src, settings, ev, timeout)
            arm.settings.update(arch=arch, row=row, source=str(src))
            arms.append(_with_report(arm))
            baseline_of[named.name] = arm_name(arch, DEFAULT)
    arms = q.select(arms, opts.arms)
    return Suite(
        name="fidelity_archs",
        description="Held-out KL (bf16 and int8 activations) of cpu-quant gptq's fidelity "
                    "methods (smoothing, head group) on a seeded tiny model of every supported "
                    "architecture, each against its own bf16 source",
        metrics=fidelity.METRICS,
        arms=arms,
        settings={**settings, "eval": ev, "shape": vars(shape), "seed": SEED,
                  "archs": list(archs), "rows": list(rows)},
        baseline=None,
        baseline_of={a.name: baseline_of[a.name] for a in arms},
        inputs={f"source_{arch}": src for arch, src in sources.items()},
        notes=notes,
        keep_artifacts="last",
    )


# -- the results page ------------------------------------------------------------------------
COMPARABLE = (*fidelity.COMPARABLE, "shape", "seed")


def _cell(per: dict | None) -> str:
    if not per or not per["kl_mean"].get("n"):
        return "—"
    w4a8 = per.get("kl_mean_w4a8") or {}
    text = f"{per['kl_mean']['median']:.5f}"
    return text + (f" / {w4a8['median']:.5f}" if w4a8.get("n") else "")


def pivot_table(runs: list, docs: Path) -> str:
    """Architectures down, the rows (fidelity methods) across: KL / W4A8 KL in nats, each
    cell from the newest of ``runs`` that measured it; then the result files."""
    import os
    from dataclasses import asdict

    from ..render import machine, summary_of

    cells: dict[str, tuple[dict, Path]] = {}
    for path, doc in runs:
        for arm, per in summary_of(doc, [asdict(m) for m in fidelity.METRICS]).items():
            cells.setdefault(arm, (per, path))
    archs = [a for a in TINY_ARCHS if any(k.startswith(f"{a}:") for k in cells)]
    rows = [r for r in ROWS if any(arm_name(a, r) in cells for a in archs)]
    lines = ["| architecture | " + " | ".join(f"`{r}`" for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for arch in archs:
        lines.append(f"| {arch} | " + " | ".join(
            _cell(cells.get(arm_name(arch, r), (None,))[0]) for r in rows) + " |")
    used = sorted({p for _, p in cells.values()}, reverse=True)
    lines += ["", "Result files: " + "; ".join(
        f"[{p.name}]({os.path.relpath(p, docs)}) (git "
        f"{machine(json.loads(p.read_text()))['sha'][:7]})" for p in used) + "."]
    return "\n".join(lines)


def render(results: Path, docs: Path) -> str:
    """The results page's block: per CPU class, the newest comparable run of each
    architecture and method, as KL / W4A8 KL."""
    from ..render import comparable_runs, machine

    parts = []
    for runs in comparable_runs(results, "fidelity_archs-2*.json", COMPARABLE):
        meta = machine(runs[0][1])
        parts += [pivot_table(runs, docs), "",
                  f"KL / W4A8 KL in nats. Machine: {meta['cpu']} ({meta['isa']}), "
                  f"{meta['cores']} cores; each cell the newest run of that arm on this CPU "
                  f"class with the same settings. Command: `python -m benchmarks run "
                  f"fidelity_archs [--arms ARCH:ROW,...]`.", ""]
    return "\n".join(parts[:-1]) if parts else "Not measured yet."
