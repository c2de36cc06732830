"""``cpu-quant report DIR``: write ``DIR/report.html`` from ``DIR/quantization_report.json``."""

from __future__ import annotations

from pathlib import Path

import click

from .conventions import json_option, stdout_for_json
from .quantize_run import friendly_errors


@click.command("report")
@click.argument("directory", type=click.Path(path_type=Path))
@json_option
@friendly_errors
def report(directory: Path, as_json: bool) -> None:
    """Write DIRECTORY/report.html: one self-contained page (inline SVG) of the run's settings,
    bits per weight, weighted SNR, fallbacks, head, fidelity, timings, memory and provenance."""
    from ..report.html import write_report_html

    with stdout_for_json(as_json) as emit:
        out = write_report_html(directory)
        click.echo(f"wrote {out}")
        emit({"command": "report", "report_html": str(out)})
