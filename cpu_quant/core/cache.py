"""Where cpu-quant keeps what it builds once per machine (the demo model, random models of
public shapes, the built-in texts' token ids): ``$CPU_QUANT_CACHE``, else
``$XDG_CACHE_HOME/cpu-quant`` (default ``~/.cache/cpu-quant``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    explicit = os.environ.get("CPU_QUANT_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cpu-quant"
