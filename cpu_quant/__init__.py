"""cpu-quant: offline checkpoint quantization and export for LLMs on edge CPUs and phones."""

from __future__ import annotations

__version__ = "0.1.0"
