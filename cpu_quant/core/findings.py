"""What a check reports: one :class:`Finding` per problem (or fact) found."""

from __future__ import annotations

from dataclasses import dataclass

SEVERITIES = ("error", "warning", "info")
# verify --source: a module read back below this SNR against its source weight is an error
# (why 6 dB: cpu_quant/verify/source.py); here so the CLI's help names it without importing torch
SOURCE_MIN_SNR_DB = 6.0


@dataclass(frozen=True)
class Finding:
    """One verification result; ``tensor`` is a tensor (or file) name, None for the config."""

    severity: str  # error | warning | info
    check: str
    tensor: str | None
    message: str

    def line(self) -> str:
        return f"{self.severity.upper():<7} {self.check:<15} {self.tensor or '-'}: {self.message}"


def error(check: str, tensor: str | None, message: str) -> Finding:
    return Finding("error", check, tensor, message)


def warning(check: str, tensor: str | None, message: str) -> Finding:
    return Finding("warning", check, tensor, message)


def info(check: str, tensor: str | None, message: str) -> Finding:
    return Finding("info", check, tensor, message)
