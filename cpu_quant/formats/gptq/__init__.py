"""GPTQ's checkpoint format, as vLLM and GPTQModel read it: its byte layout, packers and checks
(``layout``), and the plugin's kernel that runs its symmetric layers on PyTorch's tinygemm op
where this CPU's row of the serving kernel table says so (``vllm_kernel``)."""

from . import layout  # noqa: F401  (registers the format)
