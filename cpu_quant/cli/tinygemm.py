"""``cpu-quant tinygemm`` and ``cpu-quant convert``: the cpu_int4 (tinygemm W4A16) commands.

Both are click commands for the ``cpu-quant`` group (``cli.main.add_command``). ``tinygemm``
runs the same pipeline as ``gptq`` into the ``cpu_int4`` format (asymmetric grid unless
``--sym``); ``convert`` repacks between formats bit-exactly.
"""

from __future__ import annotations

import click

from ..formats import format_for_command
from .quantize_run import friendly_errors, quantize_options, run_quantize_command


@click.command("tinygemm")
@click.argument("src", required=False)
@click.argument("dst", required=False)
@quantize_options
@click.option("--sym", is_flag=True,
              help="Symmetric grid (zero = 0) instead of a scale and a zero per group.")
@friendly_errors
def tinygemm(src: str | None, dst: str | None, sym: bool, **opts) -> None:
    """W4A16 checkpoint (cpu_int4) for PyTorch's tinygemm CPU kernel, served by vLLM.

    Same pipeline and options as ``gptq``, with an asymmetric grid by default. SRC (a directory
    or a cached Hub id) defaults to the built-in demo model; DST to a directory named after the
    source and the settings. The
    result loads with ``vllm serve DST`` (through the cpu_quant plugin) or
    ``cpu_quant.load_quantized(DST)``.
    """
    fmt = format_for_command("tinygemm")
    run_quantize_command(src, dst, [fmt], sym, f"{fmt.name}-sym" if sym else fmt.name, opts)
