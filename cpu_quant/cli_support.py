"""Shared pieces of the command line: the one-line error contract every command follows."""

from __future__ import annotations

import functools
import sys

import click

from .errors import CpuQuantError


def friendly_errors(fn):
    """Turn CpuQuantError (and Ctrl-C) into a one-line message and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CpuQuantError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted: the output was not written; a quantization run can be "
                       "continued with --resume", err=True)
            sys.exit(130)

    return wrapper
