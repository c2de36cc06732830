"""Checking artifacts before they ship (``verify``, ``inspect``) and choosing a path per device.

* :func:`verify_checkpoint` (``checks.py``): structural and numerical checks of a GPTQ or
  ``cpu_int4`` checkpoint, as :class:`Finding` lines; reads headers and one tensor at a time.
* :func:`inspect_checkpoint` (``inspect.py``): a human summary from the headers alone.
* ``commands.py``: the click commands ``verify``, ``inspect`` and ``probe`` (the device probe
  itself lives in :mod:`cpu_quant.probe`).
"""

from __future__ import annotations

from .checks import Finding, VerifyReport, verify_checkpoint
from .inspect import InspectReport, inspect_checkpoint

__all__ = [
    "Finding",
    "InspectReport",
    "VerifyReport",
    "inspect_checkpoint",
    "verify_checkpoint",
]
