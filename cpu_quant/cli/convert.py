"""``cpu-quant convert``: repack a 4-bit checkpoint into another format, bit-exactly."""

from __future__ import annotations

import click

from ..formats import repackable_format_names
from .conventions import json_option, no_resume_on_interrupt, overwrite_option, stdout_for_json
from .quantize_run import friendly_errors


@click.command("convert")
@click.argument("src_dir")
@click.argument("dst")
@click.option("--to", "target", type=click.Choice(repackable_format_names()), required=True,
              help="Format to write.")
@overwrite_option
@json_option
@friendly_errors
@no_resume_on_interrupt("convert")
def convert(src_dir: str, dst: str, target: str, overwrite: bool, as_json: bool) -> None:
    """Repack a 4-bit checkpoint into another format, bit-exactly, or refuse and say why."""
    from ..convert import convert_checkpoint
    from .after_run import record_conversion

    with stdout_for_json(as_json) as emit:
        report = convert_checkpoint(src_dir, dst, target, overwrite=overwrite)
        groups = ", ".join(f"{n} x group {g}" for g, n in sorted(report.groups.items(),
                                                                 key=lambda kv: int(kv[0])))
        click.echo(f"converted {report.modules} modules ({groups}) from {report.source_format} to "
                   f"{target}: {report.output}")
        written = record_conversion(report.output, target, src_dir)
        emit({"command": "convert", **report.as_dict(), "written": [str(p) for p in written]})
