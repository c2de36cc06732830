"""``cpu-quant gptq``: the calibrated GPTQ run, into one or more formats."""

from __future__ import annotations

import click

from ..formats import DEFAULT_FORMAT, formats_help, parse_formats
from .quantize_run import friendly_errors, quantize_options, run_quantize_command


@click.command("gptq")
@click.argument("src", required=False)
@click.argument("dst", required=False)
@quantize_options
@click.option("--format", "format_list", default=DEFAULT_FORMAT, show_default=True,
              help=f"Formats to write from the one calibrated run, comma-separated: "
                   f"{formats_help()}. With one format DST is that artifact; with several, DST "
                   "holds one subdirectory per format.")
@friendly_errors
def gptq(src: str | None, dst: str | None, format_list: str, **opts) -> None:
    """Calibrated symmetric 4-bit GPTQ checkpoint for vLLM's CPU kernels.

    SRC is a directory or a Hugging Face Hub id already in the local cache (never downloaded),
    by default the built-in demo model (SmolLM2-135M-Instruct, bf16); DST defaults to
    ./<source>-gptq[-<method>]-w4g<group>. DST also gets README.md (a model card) and
    report.html.
    """
    run_quantize_command(src, dst, parse_formats(format_list), True, "gptq", opts)
