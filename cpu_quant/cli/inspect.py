"""``cpu-quant inspect``: summarise an artifact (exit 0, or 2 when it is not usable)."""

from __future__ import annotations

from pathlib import Path

import click

from .conventions import json_option, json_text
from .quantize_run import friendly_errors


@click.command("inspect")
@click.argument("directory", type=click.Path(path_type=Path))
@json_option
@friendly_errors
def inspect(directory: Path, as_json: bool) -> None:
    """Summarise an artifact at DIRECTORY: format, bits per weight, tensors, head, size."""
    from ..verify.inspect import inspect_checkpoint

    report = inspect_checkpoint(directory)
    if as_json:
        click.echo(json_text(report.to_json()))
    else:
        for line in report.lines():
            click.echo(line)
