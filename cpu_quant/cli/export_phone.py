"""``cpu-quant export-phone``: the thin CLI over ``pipeline.export_phone``."""

from __future__ import annotations

import click

from ..export.pipeline import DEFAULT_SCHEME, PhoneExportSettings
from ..export.pipeline import export_phone as run_export_phone
from ..export.qnn import DEFAULT_SOC
from .conventions import RunConventions, overwrite_option, run_options, stdout_for_json
from .quantize_run import friendly_errors


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_summary(report: dict, out: str) -> None:
    v = report["verification"]
    pq, pf, qf = v["pte_vs_quantized"], v["pte_vs_float"], v["quantized_vs_float"]
    lines = [f"wrote {out}  ({report['backend']} {report['scheme']})"]
    for name, info in report["produced"].items():
        lines.append(f"  {name:<18} {_mib(info['bytes']):>11}  {info['what']}")
    sizes = report["sizes"]
    lines.append(f"  size vs float32 program: {sizes['ratio_vs_float32']:.3f} "
                 f"({_mib(sizes['float32_bytes'])} unquantized)")
    weights = report.get("weights")
    if weights:
        kinds = ", ".join(f"{n} {k}" for k, n in weights["linears"].items())
        lines.append(f"  weights: {kinds}")
        for note in weights["notes"]:
            lines.append(f"  note: {note}")
    stored = report.get("stored_weights")
    if stored:
        lines.append(f"  read back from model.pte: {stored['equal']} of {stored['linears']} "
                     "linears hold exactly these codes and scales")
    cal = report["calibration"]
    lines.append(f"  calibration: {cal['samples']} samples ({cal.get('source') or 'none'})")
    lines.append(f"  held-out: {v['heldout_tokens']} tokens in {v['heldout_windows']} windows")
    lines.append(f"  {'':<22}{'SNR dB':>8}{'top-1':>8}{'KL':>10}")
    for label, c in (("pte vs float", pf), ("pte vs quantized eager", pq),
                     ("quantized vs float", qf)):
        lines.append(f"  {label:<22}{str(c['snr_db']):>8}{c['top1_agreement']:>8.3f}"
                     f"{c['mean_kl']:>10.4f}")
    ppl = v["perplexity"]
    fl = v["floors"]["vs_float"]
    lines.append(f"  perplexity: float {ppl['float']:.4g}, model.pte {ppl['pte']:.4g} "
                 f"({v['perplexity_ratio']:.3f}x); floors vs float: SNR >= {fl['min_snr_db']:g} dB, "
                 f"top-1 >= {fl['min_top1']:g}, perplexity <= {fl['max_ppl_ratio']:g}x")
    lines.append(f"  decode SNR vs quantized eager: {v['decode_snr_db_vs_quantized']} dB")
    for g in v["greedy"]:
        lines.append(f"  greedy {g['prompt']!r} -> {g['pte_text']!r} "
                     f"({g['matching_prefix_vs_quantized']}/{len(g['pte_tokens'])} tokens "
                     "match the quantized eager graph)")
    if report.get("qnn_lowering") == "not-done":
        lines.append("  NOT lowered to the HTP: without the Qualcomm SDK, the program is verified "
                     "on ExecuTorch's portable kernels on this host; the HTP lowering needs the "
                     "SDK. qnn_*.pt2 are the quantized programs for QNN lowering.")
        lines.append("  next: " + report["qnn_next_step"])
    click.echo("\n".join(lines))


@click.command("export-phone")
@click.argument("src", type=click.Path(file_okay=False, path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@click.option("--backend", type=click.Choice(["qnn", "xnnpack"]), default="qnn", show_default=True,
              help="qnn: Qualcomm HTP (w8a16 or 16a4w, calibrated). Without the Qualcomm SDK, "
                   "the program is verified on ExecuTorch's portable kernels on this host; the "
                   "HTP lowering needs the SDK. xnnpack: phone CPU.")
@click.option("--scheme", default=None,
              help=f"qnn: w8a16 or 16a4w (default {DEFAULT_SCHEME['qnn']}); xnnpack: 8da8w, "
                   f"8da4w or fp32 (default {DEFAULT_SCHEME['xnnpack']}). The 4-bit weights of "
                   "8da4w and 16a4w are GPTQ codes (--quantized, or a GPTQ run made here).")
@click.option("--quantized", default=None, type=click.Path(file_okay=False, path_type=str),
              help="8da4w/16a4w: take the 4-bit codes of this `cpu-quant gptq --positive-scales` "
                   "output of SRC (16a4w: --group -1) instead of running GPTQ here.")
@click.option("--max-seq-len", type=int, default=512, show_default=True,
              help="Static KV-cache length (prompt + generated tokens).")
@click.option("--prefill-len", type=int, default=64, show_default=True,
              help="Tokens per prefill call (capped at --max-seq-len). 1 exports the decode "
                   "method alone, which then takes prompts a token at a time: half the "
                   "lowering time, slower prompts.")
@click.option("--calib", default=None,
              help="Calibration text: .txt, .jsonl or a directory; default: built-in corpus. "
                   "Calibrates QNN's activations, the 8-bit weights' scale search, 8da8w's "
                   "smoothing and the GPTQ run.")
@click.option("--calib-samples", type=int, default=16, show_default=True,
              help="Calibration windows of min(128, --max-seq-len) tokens (QNN activations, "
                   "8-bit scale search, 8da8w smoothing); 0 = none of these, for comparison "
                   "only (the GPTQ run keeps --samples).")
@click.option("--samples", "--gptq-samples", "gptq_samples", type=int, default=128,
              show_default=True,
              help="Calibration windows of the GPTQ run (8da4w/16a4w without --quantized), as "
                   "gptq's --samples.")
@click.option("--seqlen", "--gptq-seqlen", "gptq_seqlen", type=int, default=512,
              show_default=True, help="Tokens per window of the GPTQ run, as gptq's --seqlen.")
@click.option("--smooth/--no-smooth", "--gptq-smooth/--no-gptq-smooth", "gptq_smooth", default=None,
              help="The GPTQ run folds activation smoothing into the weights first (`cpu-quant "
                   "gptq --smooth`), and the program takes the folded norms. Default: on for "
                   "8da4w (int8 activations), off for 16a4w. An artifact given with --quantized "
                   "brings its own folds.")
@click.option("--group", "--group-size", "group_size", type=int, default=32, show_default=True,
              help="8da4w: the group of the GPTQ run made here, 32, 64 or 128 (a linear it "
                   "does not divide takes the largest smaller one that does, else 8-bit "
                   "weights; reported). With --quantized, the artifact's groups.")
@click.option("--head-bits", type=click.Choice(["4", "8"]), default="4", show_default=True,
              help="8da4w/16a4w without --quantized: the output head as GPTQ's 4-bit codes (4), "
                   "or left out of the GPTQ run and stored at 8 bits per output channel (8; "
                   "with 8da4w, the 8da8w output layer of ExecuTorch's Llama-3.2 recipe).")
@click.option("--soc", default=DEFAULT_SOC, show_default=True,
              help="Qualcomm SoC for the HTP lowering (used only with QNN_SDK_ROOT).")
@overwrite_option
@run_options
@friendly_errors
def export_phone(src: str, out: str, backend: str, scheme: str | None, quantized: str | None,
                 max_seq_len: int, prefill_len: int, calib: str | None, calib_samples: int,
                 gptq_samples: int, gptq_seqlen: int, gptq_smooth: bool | None, group_size: int,
                 head_bits: str, soc: str, overwrite: bool, **opts) -> None:
    """Export SRC (a Hugging Face Llama-family checkpoint) to a verified ExecuTorch program in OUT.

    Nothing is written to OUT unless the program, run by ExecuTorch's runtime on held-out text,
    meets its scheme's fixed floors against the float model and agrees with its own quantized
    eager graph (exit code 3 otherwise); bad input exits with code 2. See docs/phone.md.
    """
    settings = PhoneExportSettings(
        backend=backend, scheme=scheme, max_seq_len=max_seq_len, prefill_len=prefill_len,
        calib=calib, calib_samples=calib_samples, group_size=group_size, soc=soc,
        quantized=quantized, gptq_samples=gptq_samples, gptq_seqlen=gptq_seqlen,
        gptq_smooth=gptq_smooth, head_bits=int(head_bits))
    conv = RunConventions.take(opts)
    with stdout_for_json(conv.as_json) as emit:
        report = run_export_phone(src, out, settings, overwrite=overwrite, progress=conv.progress)
        print_summary(report, out)
        emit({"command": "export-phone", "output": out, **report})
