"""``cpu-quant tinygemm`` and ``cpu-quant convert``: the cpu_int4 (tinygemm W4A16) commands.

Both are click commands for the ``cpu-quant`` group (``cli.main.add_command``). ``tinygemm``
runs the same pipeline as ``gptq`` through ``CpuInt4Layout`` (asymmetric grid unless
``--sym``); ``convert`` repacks a symmetric GPTQ checkpoint bit-exactly.
"""

from __future__ import annotations

import click

from .cli_support import friendly_errors, quantize_options, run_quantize_command
from .errors import CpuQuantError


def _check_kernel_groups(opts: dict) -> None:
    """Refuse, before any work, a group the tinygemm kernel cannot take (``-1``, one group per
    row) or the pipeline cannot write (it writes 32, 64 and 128; the kernel also takes 256)."""
    from .quantize.plan import VLLM_GROUPS
    from .quantize.tinygemm_pack import KERNEL_GROUPS

    allowed = sorted(set(KERNEL_GROUPS) & set(VLLM_GROUPS))
    for flag, value in (("--group", opts["group"]), ("--head-group", opts["head_group"])):
        if value is not None and value not in allowed:
            raise CpuQuantError(f"{flag} {value}: cpu-quant tinygemm writes groups of "
                                f"{', '.join(map(str, allowed))} (the tinygemm kernel has no "
                                "one-group-per-row mode)")


@click.command("tinygemm")
@click.argument("src", required=False)
@click.argument("dst", required=False)
@quantize_options
@click.option("--sym", is_flag=True,
              help="Symmetric grid (zero = 0) instead of a scale and a zero per group.")
@friendly_errors
def tinygemm(src: str | None, dst: str | None, sym: bool, **opts) -> None:
    """W4A16 checkpoint (cpu_int4) for PyTorch's tinygemm CPU kernel, served by vLLM.

    Same pipeline and options as ``gptq``, with an asymmetric grid by default. SRC defaults to
    the built-in demo model; DST to a directory named after the source and the settings. The
    result loads with ``vllm serve DST`` (through the cpu_quant plugin) or
    ``cpu_quant.load_quantized(DST)``.
    """
    from .quantize.tinygemm_pack import CpuInt4Layout

    _check_kernel_groups(opts)
    run_quantize_command(src, dst, CpuInt4Layout(symmetric=sym),
                         "cpu_int4-sym" if sym else "cpu_int4", opts)


@click.command("convert")
@click.argument("gptq_dir")
@click.argument("dst")
@click.option("--to", "target", type=click.Choice(["cpu_int4"]), required=True,
              help="Layout to write.")
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
@friendly_errors
def convert(gptq_dir: str, dst: str, target: str, overwrite: bool) -> None:
    """Repack a symmetric 4-bit GPTQ checkpoint into another layout, bit-exactly."""
    from .quantize.tinygemm_pack import convert_gptq_to_cpu_int4

    report = convert_gptq_to_cpu_int4(gptq_dir, dst, overwrite=overwrite)
    groups = ", ".join(f"{n} x group {g}" for g, n in sorted(report.groups.items(),
                                                             key=lambda kv: int(kv[0])))
    click.echo(f"converted {report.modules} modules ({groups}) to {target}: {report.output}")
