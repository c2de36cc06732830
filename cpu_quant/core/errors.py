"""User-facing errors: the CLI prints these as one line and exits non-zero, never a traceback."""

from __future__ import annotations


class CpuQuantError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 2


class VerificationFailed(CpuQuantError):
    """An artifact was produced but failed its own correctness check."""

    exit_code = 3


class Interrupted(CpuQuantError):
    """The user stopped a run (Ctrl-C / SIGTERM) at a safe point; its state can be resumed."""

    exit_code = 130
