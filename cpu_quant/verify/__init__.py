"""Checking artifacts before they ship (``verify``, ``inspect``) and choosing a path per device.

* :func:`verify_checkpoint` (``checks.py``): structural and numerical checks of an artifact of
  any registered format, as :class:`Finding` lines; reads headers and one tensor at a time.
* :func:`inspect_checkpoint` (``inspect.py``): a human summary from the headers alone.
* ``findings.py``: :class:`Finding`, which format modules also yield (it imports nothing, so
  ``cpu_quant.formats`` can use it without importing the checks).
* ``commands.py``: the click commands ``verify``, ``inspect`` and ``probe`` (the device probe
  itself lives in :mod:`cpu_quant.probe`).

The names below are loaded on first use, so importing ``cpu_quant.core.findings`` does not
import the checks (which import the formats registry).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Finding": "findings",
    "VerifyReport": "checks",
    "verify_checkpoint": "checks",
    "InspectReport": "inspect",
    "inspect_checkpoint": "inspect",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)
