"""``cpu_int4``: PyTorch's tinygemm CPU kernel's weights as portable nibbles: the byte layout,
packers and checks (``layout``), the op that runs them in plain PyTorch and ``load_quantized``
(``kernel``), and the vLLM quantization method the plugin registers (``vllm_method``)."""

from . import layout  # noqa: F401  (registers the format)
