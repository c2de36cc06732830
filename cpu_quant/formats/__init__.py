"""On-disk formats, one module each, behind one registry (``base.py``).

* ``gptq``: GPTQ v1 safetensors for vLLM's CPU kernels (and GPTQModel, transformers/optimum);
* ``cpu_int4``: portable nibbles for PyTorch's tinygemm CPU kernel, repacked at load;
* ``gguf``: a llama.cpp GGUF file with Q4_0 blocks, the same grid as ``gptq``;
* ``gguf:q4_k_m``, ``gguf:q4_k_s``, ``gguf:iq4_nl``: llama.cpp's file types, each tensor on
  the type llama.cpp gives it (``gguf/mix.py``), quantized on that type's grid.

Each module owns its byte layout (its docstring), ``pack``/``unpack``, the tensor specs
``verify`` checks, the config or metadata it writes, and its limits. Nothing outside this
package branches on which format it holds: it asks the registry.
"""

from __future__ import annotations

from . import cpu_int4, gguf, gptq  # noqa: F401  (registration)
from .base import (
    DEFAULT_FORMAT,
    Format,
    Limits,
    TensorSpec,
    combined_limits,
    format_for_command,
    format_for_quant_method,
    format_names,
    format_owning,
    formats_help,
    get_format,
    parse_formats,
    repackable_format_names,
)
from .safetensors import SafetensorsFormat
from .sink import ArtifactInfo, Sink

__all__ = [
    "DEFAULT_FORMAT", "ArtifactInfo", "Format", "Limits", "SafetensorsFormat", "Sink", "TensorSpec",
    "combined_limits", "format_for_quant_method", "format_names", "format_owning", "get_format",
    "parse_formats", "format_for_command", "formats_help", "repackable_format_names",
]
