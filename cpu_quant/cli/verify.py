"""``cpu-quant verify``: check an artifact's structure (and, with ``--source``, its weights).

Exit codes (``inspect`` and ``probe`` follow the same):

* 0: clean (``verify``: no error finding; warnings and infos allowed);
* 1: ``verify`` found at least one error;
* 2 (``CpuQuantError.exit_code``): the input is not usable at all (no such directory, no
  config, not a quantized checkpoint, an unreadable cpuinfo file), printed as one line on
  stderr, never a traceback.

``--json`` prints one JSON document on stdout (schemas in docs/verify.md) with the same exit
codes; text mode prints one line per finding, then a summary line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..core.findings import SOURCE_MIN_SNR_DB as MIN_SNR_DB
from .conventions import json_option, json_text
from .quantize_run import friendly_errors

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@click.command("verify")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--source", "source", type=click.Path(path_type=Path), default=None,
              help="The bf16 model the artifact was made from: read every quantized module "
                   "back and compare it with the source weight (SNR per module); a module "
                   f"below {MIN_SNR_DB:g} dB (swapped, transposed, permuted, wrong scales) is "
                   "an error.")
@json_option
@friendly_errors
def verify(directory: Path, source: Path | None, as_json: bool) -> None:
    """Check an artifact (a GPTQ or cpu_int4 checkpoint directory, a GGUF file) at DIRECTORY;
    exit 1 when anything is wrong."""
    from ..verify.checks import verify_checkpoint
    from ..verify.source import check_source, compare_with_source

    if source is not None:
        check_source(source)  # an unusable --source is refused before the artifact's checks
    report = verify_checkpoint(directory)
    if source is not None:
        findings, report.source = compare_with_source(directory, source)
        report.findings.extend(findings)
    if as_json:
        click.echo(json_text(report.to_json()))
    else:
        for finding in sorted(report.findings, key=lambda f: SEVERITY_ORDER[f.severity]):
            click.echo(finding.line())
        if report.source is not None:
            s = report.source
            click.echo(f"source: {s['modules']} modules against {s['source']}, SNR min "
                       f"{s['min_db']} dB, median {s['median_db']} dB; worst:")
            for row in s["worst"]:
                click.echo(f"  {row['snr_db']:>7.2f} dB  {row['module']}")
            if s.get("kept_tensors"):
                click.echo(f"source: {s['kept_tensors']} kept tensors (vision tower, projector) "
                           "compared bit for bit")
        conv = f", {report.zero_convention} zeros" if report.zero_convention else ""
        fmt = report.format or "unknown format"
        click.echo(f"verify: {len(report.errors)} error(s), {len(report.warnings)} warning(s) "
                   f"({fmt}{conv}, {report.quantized_modules} quantized linears) in {directory}")
    sys.exit(0 if report.ok else 1)
