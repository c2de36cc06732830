"""The ``cpu-quant`` command line: parse, call library functions, print progress and a summary.

Every command turns a ``CpuQuantError`` into one line on stderr and a non-zero exit; no
traceback reaches the user for bad input.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_support import (
    _print_fidelity,
    friendly_errors,
    quantize_options,
    run_quantize_command,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cpu-quant")
def main() -> None:
    """Quantize and export LLM checkpoints for edge CPUs and phones."""


@main.command()
@click.argument("src", required=False)
@click.argument("dst", required=False)
@quantize_options
@click.option("--format", "format_list", default="gptq", show_default=True,
              help="Formats to write from the one calibrated run, comma-separated: gptq (vLLM), "
                   "cpu_int4 (tinygemm), gguf (llama.cpp, Q4_0). With one format DST is that "
                   "artifact; with several, DST holds one subdirectory per format.")
@friendly_errors
def gptq(src: str | None, dst: str | None, format_list: str, **opts) -> None:
    """Calibrated symmetric 4-bit GPTQ checkpoint for vLLM's CPU kernels.

    SRC defaults to the built-in demo model (SmolLM2-135M-Instruct, bf16); DST defaults to a
    directory named after the source and the settings.
    """
    from .formats import parse_formats

    run_quantize_command(src, dst, parse_formats(format_list), True, "gptq", opts)


@main.command("eval")
@click.argument("quant")
@click.option("--reference", required=True, help="The bf16 source checkpoint directory.")
@click.option("--windows", type=int, default=32, show_default=True, help="Held-out windows scored.")
@click.option("--seqlen", type=int, default=512, show_default=True, help="Tokens per window.")
@click.option("--prompts", type=int, default=12, show_default=True, help="Greedy prompts.")
@click.option("--new-tokens", type=int, default=32, show_default=True, help="Greedy tokens per prompt.")
@click.option("--text", default=None, help="Held-out text file instead of the built-in split.")
@click.option("--w4a8", is_flag=True,
              help="Also report fidelity with int8-per-token activations, as vLLM's AMX W4A8 "
                   "kernel computes (emulated in torch).")
@click.option("--json", "json_out", default=None, help="Also write the report as JSON to this file.")
@friendly_errors
def eval_cmd(quant: str, reference: str, windows: int, seqlen: int, prompts: int, new_tokens: int,
             text: str | None, w4a8: bool, json_out: str | None) -> None:
    """Fidelity of a quantized checkpoint against its bf16 source on held-out text."""
    from .eval.fidelity import EvalSettings, evaluate_artifact
    from .io.artifact import check_destination

    settings = EvalSettings(windows=windows, seqlen=seqlen, prompts=prompts, new_tokens=new_tokens,
                            text=text)
    settings.validate()
    if json_out:  # before minutes of evaluation, not after
        check_destination(json_out, [quant, reference], overwrite=True, directory=False)
    variants = ("weights", "w4a8_emulated") if w4a8 else ("weights",)
    fid = evaluate_artifact(quant, reference, settings, progress=True, variants=variants)
    _print_fidelity(fid)
    if json_out:
        out = {k: v.as_dict() for k, v in fid.items()}
        Path(json_out).write_text(json.dumps(out if w4a8 else out["weights"], indent=2) + "\n")


def _register_commands() -> None:
    from .commands_tinygemm import convert, tinygemm
    from .export.commands import export_phone
    from .verify.commands import inspect, probe, verify

    for command in (tinygemm, convert, export_phone, verify, inspect, probe):
        main.add_command(command)


_register_commands()

if __name__ == "__main__":
    main()
