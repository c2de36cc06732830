"""cpu-quant: offline checkpoint quantization and export for LLMs on edge CPUs and phones."""

from __future__ import annotations

import logging

from .core import __version__  # noqa: F401  (the package's version)


class _DropKnownNoise(logging.Filter):
    """torchao 0.18 (installed for export-phone) logs, on every import by transformers, that its
    CUDA-only extensions do not load on a CPU build, and torch warns about the enums it registers.
    Neither concerns a CPU user; every other record of these loggers passes."""

    NOISE = ("Failed to load", "is an Enum subclass and is now natively supported")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.NOISE)


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_DropKnownNoise())


def load_quantized(path, **kwargs):
    """A transformers model whose linears run PyTorch's tinygemm kernel (``cpu_int4``); see
    ``cpu_quant.formats.cpu_int4.kernel.load_quantized``."""
    from .formats.cpu_int4.kernel import load_quantized as _load

    return _load(path, **kwargs)
