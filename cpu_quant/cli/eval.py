"""``cpu-quant eval``: fidelity of a quantized checkpoint against its bf16 source."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ..core.errors import CpuQuantError
from ..eval.settings import DEFAULT_EVAL, FULL_EVAL, EvalSettings
from ..hub import resolve_checkpoint
from .conventions import RunConventions, json_text, no_resume_on_interrupt, run_options, stdout_for_json
from .quantize_run import friendly_errors


def eval_settings(full: bool, text: str | None, sizes: dict) -> EvalSettings:
    base = FULL_EVAL if full else DEFAULT_EVAL
    return base.with_overrides(text=text, **{k: sizes.get(k) for k in
                                             ("windows", "seqlen", "prompts", "new_tokens")})


def _eval_provenance(settings: EvalSettings) -> dict:
    import torch

    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _reference_grid(ref_path: Path, conv: RunConventions) -> dict:
    """The grid the reference's weights already sit on (``core/source_grid.py``), said when it
    is one: a 4-bit method on the same grid recovers such weights almost exactly."""
    from ..core.io.checkpoint import open_checkpoint
    from ..core.source_grid import checkpoint_grid

    ckpt = open_checkpoint(ref_path)
    try:
        grid = checkpoint_grid(ckpt)
    finally:
        ckpt.close()
    if grid.on_a_grid:
        conv.note(f"the reference's weights already sit on a quantization grid ({grid.summary()}):"
                  " a method on that grid recovers them almost exactly; judge methods on a model"
                  " whose grid differs")
    return grid.to_json()


def run_eval(quant: str | None, reference: str | None, full: bool, text: str | None, w4a8: bool,
             save_reference: str | None, reference_logits: str | None,
             output_json: str | None, *, sizes: dict, conv: RunConventions) -> dict:
    from ..eval.fidelity import evaluate_artifact, save_reference_logits
    from ..eval.summary import fidelity_lines

    settings = eval_settings(full, text, sizes)
    if reference_logits and reference:
        raise CpuQuantError("give --reference or --reference-logits, not both")
    if reference_logits and save_reference:
        raise CpuQuantError("--save-reference needs the reference model (--reference), not "
                            "--reference-logits")
    if not reference and not reference_logits:
        raise CpuQuantError("give --reference SRC (the bf16 source) or --reference-logits FILE")
    if quant is None and not save_reference:
        raise CpuQuantError("give QUANT (the checkpoint to score), or --save-reference FILE to "
                            "save the reference's logits only")
    ref_path = resolve_checkpoint(reference, "--reference") if reference else None
    settings.validate()
    from ..core.io.artifact import check_destination

    for written in (output_json, save_reference):  # before minutes of evaluation, not after
        if written:
            check_destination(written, [p for p in (quant, reference) if p], overwrite=True,
                              directory=False)
    doc: dict = {"command": "eval", "quantized": quant, "reference": str(ref_path) if ref_path else None,
                 "reference_logits": reference_logits, "settings": settings.__dict__.copy()}
    t0 = time.perf_counter()
    with stdout_for_json(conv.as_json) as emit:
        if quant is None:
            nbytes = save_reference_logits(ref_path, save_reference, settings, conv.progress)
            conv.note(f"saved the reference's logits: {save_reference} "
                      f"({nbytes / 2**20:.1f} MiB)")
            doc.update(saved_reference=save_reference, fidelity=None)
        else:
            quant_path = resolve_checkpoint(quant, "QUANT")
            variants = ("weights", "w4a8_emulated") if w4a8 else ("weights",)
            fid = evaluate_artifact(quant_path, ref_path, settings, progress=conv.progress,
                                    variants=variants, reference_logits=reference_logits,
                                    save_reference=save_reference)
            if save_reference:
                conv.note(f"saved the reference's logits: {save_reference}")
            doc.update(quantized=str(quant_path), saved_reference=save_reference,
                       fidelity={k: v.as_dict() for k, v in fid.items()})
            click.echo("\n".join(fidelity_lines(fid)))
        if ref_path is not None:
            doc["reference_grid"] = _reference_grid(ref_path, conv)
        doc["seconds"] = round(time.perf_counter() - t0, 1)
        doc["provenance"] = _eval_provenance(settings)
        emit(doc)
    if output_json:
        from ..core.io.artifact import write_text_atomic

        try:
            write_text_atomic(Path(output_json), json_text(doc) + "\n")
        except OSError as exc:
            raise CpuQuantError(f"cannot write --output-json {output_json}: "
                                f"{exc.strerror or exc}") from None
    return doc


@click.command("eval")
@click.argument("quant", required=False)
@click.option("--reference", default=None,
              help="The bf16 source checkpoint (a directory or a cached Hub id); not needed "
                   "with --reference-logits.")
@click.option("--full", is_flag=True,
              help=f"The full setting: {FULL_EVAL.windows} windows x {FULL_EVAL.seqlen} tokens, "
                   f"{FULL_EVAL.prompts} greedy prompts x {FULL_EVAL.new_tokens} tokens "
                   "(explicit options still win).")
@click.option("--windows", type=int, default=None,
              help=f"Held-out windows scored [default: {DEFAULT_EVAL.windows}].")
@click.option("--seqlen", type=int, default=None,
              help=f"Tokens per window [default: {DEFAULT_EVAL.seqlen}].")
@click.option("--prompts", type=int, default=None,
              help=f"Greedy prompts [default: {DEFAULT_EVAL.prompts}].")
@click.option("--new-tokens", type=int, default=None,
              help=f"Greedy tokens per prompt [default: {DEFAULT_EVAL.new_tokens}].")
@click.option("--text", default=None,
              help="Held-out text: 'austen' (the built-in split, default), a held-out domain "
                   "that the calibration mix does not hold ('italian', 'javascript', "
                   "'debian-faq': dialogue in the chat template), or a file.")
@click.option("--w4a8", is_flag=True,
              help="Also report fidelity with int8-per-token activations, as vLLM's AMX W4A8 "
                   "kernel computes (emulated in torch).")
@click.option("--save-reference", type=click.Path(dir_okay=False), default=None,
              help="Also save the reference's logits (factored: the output head's input per "
                   "position and the head), NLLs and greedy tokens to this file (QUANT may then "
                   "be left out).")
@click.option("--reference-logits", type=click.Path(dir_okay=False), default=None,
              help="Score against a file written by --save-reference instead of running the "
                   "reference (refused if its held-out tokens differ).")
@click.option("--output-json", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON summary (as --json prints it) to this file.")
@run_options
@friendly_errors
@no_resume_on_interrupt("eval")
def eval_cmd(quant: str | None, reference: str | None, full: bool, text: str | None, w4a8: bool,
             save_reference: str | None, reference_logits: str | None,
             output_json: str | None, **opts) -> None:
    """Fidelity of a quantized checkpoint against its bf16 source on held-out text.

    Reports KL(bf16 || quant) mean ± standard error with its median, p90, p99 and max, the
    perplexity of each model ± error, the perplexity difference ± error, same top-1 ± error and
    greedy reproduction (docs/gptq.md#fidelity-cpu-quant-eval).
    """
    conv = RunConventions.take(opts)
    run_eval(quant, reference, full, text, w4a8, save_reference, reference_logits, output_json,
             sizes=opts, conv=conv)
