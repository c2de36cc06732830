"""What a vLLM patch reports: the contract between the plugin (``cpu_quant.runtime_patches``)
and every module it applies, its own and those the format packages provide."""

from __future__ import annotations

import logging
from dataclasses import dataclass

# Statuses a PatchOutcome can carry, and the log level each is reported at. "skipped" means the
# target is missing, changed or already fixed upstream: worth a warning, because the fix is not
# active. "deferred" means the target module is not imported in this process yet; the patch logs
# a second line when it is.
LEVELS = {
    "applied": logging.INFO,
    "deferred": logging.INFO,
    "off": logging.INFO,
    "absent": logging.INFO,
    "skipped": logging.WARNING,
    "failed": logging.ERROR,
}


@dataclass(frozen=True)
class PatchOutcome:
    """What happened to one patch in this process."""

    name: str
    status: str  # one of LEVELS
    reason: str
