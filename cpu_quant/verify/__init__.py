"""Checking artifacts before they ship (``verify``, ``inspect``) and choosing a path per device.

* :func:`verify_checkpoint` (``checks.py``): structural and numerical checks of an artifact of
  any registered format, as :class:`Finding` lines; reads headers and one tensor at a time.
* :func:`inspect_checkpoint` (``inspect.py``): a human summary from the headers alone.
* ``source.py``: ``verify --source``, every quantized module read back against the source.

:class:`Finding` lives in ``cpu_quant.core.findings``, which format packages also yield. The
names below are loaded on first use.
"""

from __future__ import annotations

import importlib

_LAZY = {
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
