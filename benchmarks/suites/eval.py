"""Suite ``eval``: how long ``cpu-quant eval`` takes at its default setting on the demo model.

One arm, ``eval-default``: ``cpu-quant eval ART --reference SRC`` with no setting flags (32
held-out windows x 512 tokens, 12 greedy prompts x 32 tokens), the bf16 reference run afresh
each pass, on a GPTQ artifact of the demo model built once (``cpu-quant gptq SRC ART --samples
8 --seqlen 256 --no-eval``: the artifact's calibration does not change the evaluation's work).
Metrics: wall and CPU seconds of the whole command (start-up and model loading included),
3 passes. ``collect`` checks that the default setting reached the evaluation (rule 4): the
summary's windows, tokens per window and prompts.

Smoke mode (CI): the tiny smoke model, ``--windows 2 --seqlen 32 --prompts 2``.
"""

from __future__ import annotations

import json
from pathlib import Path

from cpu_quant.eval.settings import EvalSettings

from ..harness import CPU_SECONDS, WALL_SECONDS, Arm, Command, PassContext, RunRecord, Suite
from ..render import harness_block
from .quantize import CLI, TIMEOUT_REAL, TIMEOUT_SMOKE, SuiteOptions, source_model

BUILD = ["--samples", "8", "--seqlen", "256", "--no-eval"]
SMOKE_BUILD = ["--samples", "4", "--seqlen", "64", "--no-eval"]
SMOKE_EVAL = ["--windows", "2", "--seqlen", "32", "--prompts", "2"]


def build(opts: SuiteOptions) -> Suite:
    src = source_model(opts)
    timeout = TIMEOUT_SMOKE if opts.smoke else TIMEOUT_REAL
    flags = SMOKE_EVAL if opts.smoke else []
    expected = EvalSettings()
    if opts.smoke:
        expected = expected.with_overrides(windows=2, seqlen=32, prompts=2)

    def build_artifact(bdir: Path) -> Command:
        return Command([*CLI, "gptq", str(src), str(bdir / "artifact"), "--overwrite",
                        *(SMOKE_BUILD if opts.smoke else BUILD)], timeout=timeout)

    def command(ctx: PassContext) -> Command:
        assert ctx.build_dir is not None
        return Command([*CLI, "eval", str(ctx.build_dir / "artifact"), "--reference", str(src),
                        "--output-json", str(ctx.workdir / "eval.json"), *flags], timeout=timeout)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        doc = json.loads((ctx.workdir / "eval.json").read_text())
        got = doc["settings"]
        for key in ("windows", "seqlen", "prompts", "new_tokens"):
            if got[key] != getattr(expected, key):
                raise ValueError(f"eval ran with {key}={got[key]}, not {getattr(expected, key)}")
        return {}

    arm = Arm("eval-default", {"flags": flags, "artifact_build": SMOKE_BUILD if opts.smoke else BUILD},
              command, collect, build=build_artifact)
    return Suite(name="eval", description="cpu-quant eval at its default setting on the demo model "
                 "(the bf16 reference run afresh each pass)", metrics=[WALL_SECONDS, CPU_SECONDS],
                 arms=[arm], settings={"source": str(src), "eval": vars(expected)},
                 baseline="eval-default")


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table."""
    return harness_block(results, docs, "eval", "python -m benchmarks run eval")
