"""``cpu-quant probe``: this machine's CPU, and which weight path to build (exit 0, or 2 for an
unreadable cpuinfo file)."""

from __future__ import annotations

from pathlib import Path

import click

from .conventions import json_option, json_text
from .quantize_run import friendly_errors


@click.command("probe")
@click.option("--priority", type=click.Choice(["speed", "fidelity"]), default="speed",
              show_default=True, help="What to favour when the hardware allows a choice.")
@click.option("--target", type=click.Choice(["cpu", "phone"]), default="cpu", show_default=True,
              help="cpu: serve on this kind of machine; phone: export a program for a phone.")
@click.option("--cpuinfo", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Decide for a recorded /proc/cpuinfo instead of this machine.")
@click.option("--meminfo", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="A recorded /proc/meminfo to go with --cpuinfo.")
@json_option
@friendly_errors
def probe(priority: str, target: str, cpuinfo: Path | None, meminfo: Path | None,
          as_json: bool) -> None:
    """Read this machine's CPU and say which weight path to build, with the command and why."""
    from ..probe import probe as run_probe

    result = run_probe(priority, target, cpuinfo, meminfo)
    if as_json:
        click.echo(json_text(result.to_json()))
    else:
        for line in result.lines():
            click.echo(line)
