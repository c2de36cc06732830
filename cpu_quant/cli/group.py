"""The ``cpu-quant`` command line: parse, call library functions, print progress and a summary.

Every command turns a ``CpuQuantError`` into one line on stderr and a non-zero exit; no
traceback reaches the user for bad input.
"""

from __future__ import annotations

import click

from .conventions import require_working_directory

require_working_directory()  # before the imports below load torch

from .quantize_run import (  # noqa: E402
    OneLineUsageErrors,
)


@click.group(cls=OneLineUsageErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cpu-quant")
def main() -> None:
    """Quantize and export LLM checkpoints for edge CPUs and phones."""


def _register_commands() -> None:
    from .convert import convert
    from .eval import eval_cmd
    from .export_phone import export_phone
    from .gptq import gptq
    from .inspect import inspect
    from .probe import probe
    from .report import report
    from .tinygemm import tinygemm
    from .verify import verify

    for command in (gptq, eval_cmd, tinygemm, convert, export_phone, verify, inspect, probe,
                    report):
        main.add_command(command)


_register_commands()
