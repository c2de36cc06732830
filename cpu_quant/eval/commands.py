"""``cpu-quant eval``: the command's body, so the click layer in ``cli.py`` stays thin."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ..cli_conventions import RunConventions, json_text, stdout_for_json
from ..core.errors import CpuQuantError
from ..hub import resolve_checkpoint
from .settings import DEFAULT_EVAL, FULL_EVAL, EvalSettings


def eval_settings(full: bool, text: str | None, sizes: dict) -> EvalSettings:
    base = FULL_EVAL if full else DEFAULT_EVAL
    return base.with_overrides(text=text, **{k: sizes.get(k) for k in
                                             ("windows", "seqlen", "prompts", "new_tokens")})


def _eval_provenance(settings: EvalSettings) -> dict:
    import torch

    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_eval(quant: str | None, reference: str | None, full: bool, text: str | None, w4a8: bool,
             save_reference: str | None, reference_logits: str | None,
             output_json: str | None, *, sizes: dict, conv: RunConventions) -> dict:
    from .fidelity import evaluate_artifact, save_reference_logits
    from .summary import fidelity_lines

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
