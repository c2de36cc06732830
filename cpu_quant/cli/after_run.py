"""What every command that writes an artifact does once the artifact is in place: the model card
(``model_card.py``) and, beside a safetensors artifact, ``report.html`` (``report/html.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..model_card import write_model_card


def read_report(directory: Path) -> dict | None:
    path = Path(directory) / "quantization_report.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply
        return None


def finish_outputs(outputs: dict[str, str], source: Path, fallback: dict | None = None
                   ) -> list[Path]:
    """Write the card (and the HTML report where a report JSON exists) for each output."""
    from ..report.html import write_report_html

    written = []
    for format_name, directory in outputs.items():
        report = read_report(Path(directory))
        written.append(write_model_card(Path(directory), report or fallback or {}, source,
                                        format_name))
        if report is not None:
            written.append(write_report_html(Path(directory)))
    return written


def record_conversion(output: str | Path, format_name: str, source: str | Path) -> list[Path]:
    """After ``convert``: the command into the copied report, then the card and the page."""
    import shlex
    import sys

    from ..quantize.pipeline import update_report

    if read_report(Path(output)) is not None:
        update_report(Path(output), convert_command_line="cpu-quant " + shlex.join(sys.argv[1:]))
    return finish_outputs({format_name: str(output)}, Path(source))
