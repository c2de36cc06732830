"""The ``cpu-quant`` command line: parse, call library functions, print progress and a summary.

Every command turns a ``CpuQuantError`` into one line on stderr and a non-zero exit; no
traceback reaches the user for bad input.
"""

from __future__ import annotations

import click

from .cli_conventions import require_working_directory

require_working_directory()  # before the imports below load torch

from .cli_conventions import RunConventions, no_resume_on_interrupt, run_options  # noqa: E402
from .cli_support import (  # noqa: E402
    OneLineUsageErrors,
    friendly_errors,
    quantize_options,
    run_quantize_command,
)
from .eval.settings import DEFAULT_EVAL, FULL_EVAL  # noqa: E402


@click.group(cls=OneLineUsageErrors, context_settings={"help_option_names": ["-h", "--help"]})
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

    SRC is a directory or a Hugging Face Hub id already in the local cache (never downloaded),
    by default the built-in demo model (SmolLM2-135M-Instruct, bf16); DST defaults to
    ./<source>-gptq[-<method>]-w4g<group>. DST also gets README.md (a model card) and
    report.html.
    """
    from .formats import parse_formats

    run_quantize_command(src, dst, parse_formats(format_list), True, "gptq", opts)


@main.command("eval")
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
@click.option("--text", default=None, help="Held-out text file instead of the built-in split.")
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
    from .eval.commands import run_eval

    conv = RunConventions.take(opts)
    run_eval(quant, reference, full, text, w4a8, save_reference, reference_logits, output_json,
             sizes=opts, conv=conv)


def _register_commands() -> None:
    from .commands_tinygemm import convert, tinygemm
    from .export.commands import export_phone
    from .report.commands import report
    from .verify.commands import inspect, probe, verify

    for command in (tinygemm, convert, export_phone, verify, inspect, probe, report):
        main.add_command(command)


_register_commands()

if __name__ == "__main__":
    main()
