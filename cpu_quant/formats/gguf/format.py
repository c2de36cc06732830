"""The ``gguf`` format in the registry, and the command line llama.cpp's tools need to run its
files."""

from __future__ import annotations

import shlex
from pathlib import Path

from ...core.errors import CpuQuantError
from ...core.findings import Finding
from ...core.vision_language import family_of
from ..base import Format, Limits, Serving
from .architectures import arch_spec
from .q4_0 import BLOCK, Q4_0, pack_q4_0, unpack_q4_0
from .reader import _open, gguf_file_in, inspect, unpack, verify
from .sink import GGUFSink

# On a CPU with AMX, llama.cpp (the vendored 0.3.36 build and upstream alike; llama.cpp #20824,
# "segfault in ggml_backend_amx_mul_mat") repacks Q4_0 weights into its AMX buffer type and then
# crashes with SIGSEGV in the first decode (llama-perplexity --kl-divergence, llama-imatrix,
# llama-cli). With repacking off the weights stay in the file's layout and run everywhere.
LLAMA_CPP_NO_REPACK = "--no-repack"
NO_REPACK_WHY = ("`--no-repack` turns off llama.cpp's weight repacking: on CPUs with AMX, "
                 "llama.cpp repacks Q4_0 weights for AMX and then crashes (SIGSEGV) at the "
                 "first token; without repacking it runs on every CPU.")


def llama_cpp_command(tool: str | Path, model: str | Path, *args: str | Path) -> list[str]:
    """The argv of a llama.cpp tool that runs ``model`` (``llama-cli``, ``llama-server``,
    ``llama-perplexity``, ``llama-imatrix``: the tools parsing llama.cpp's common options):
    ``tool -m MODEL --no-repack ARGS``. ``llama-quantize`` only rewrites a file, never runs
    it, and takes no such option."""
    return [str(tool), "-m", str(model), LLAMA_CPP_NO_REPACK, *map(str, args)]



class GGUFFormat(Format, name="gguf"):
    """llama.cpp's GGUF with Q4_0 linears (see the module docstring for the layout)."""

    summary = "llama.cpp, Q4_0"

    limits = Limits(groups=(128, 64, 32), row_group=True, k_multiple=BLOCK, n_multiple=1,
                    stores_zeros=False, kernel="llama.cpp Q4_0")

    def __init__(self, pre_tokenizer: str | None = None) -> None:
        self.pre_tokenizer = pre_tokenizer

    def serving(self, target: Path) -> Serving:
        return Serving("llama.cpp", shlex.join(llama_cpp_command("llama-cli", target)),
                       (NO_REPACK_WHY,))

    def refuse_source(self, source_config: dict) -> str | None:
        """Why a model with this config.json cannot be written as GGUF (checked before work)."""
        family = family_of(source_config)
        if family is not None:
            return (f"{family.name} is a vision-language model: this GGUF writer has no layout "
                    f"for its language model under {family.language_model} nor llama.cpp's "
                    "separate projector file (mmproj); --format gptq serves it with vLLM")
        try:
            arch_spec(source_config)
        except CpuQuantError as e:
            return str(e)
        return None

    def open_sink(self, directory: Path, n_layers: int, resume_state: dict | None) -> GGUFSink:
        return GGUFSink(self, directory, n_layers, resume_state)

    def owns(self, path: Path) -> bool:
        return gguf_file_in(Path(path)) is not None

    def verify_artifact(self, path: Path) -> tuple[list[Finding], int]:
        file = gguf_file_in(Path(path))
        quantized = sum(t.tensor_type == Q4_0 for t in _open(file).tensors)
        return verify(file), quantized

    def inspect_artifact(self, path: Path) -> dict:
        return inspect(gguf_file_in(Path(path)))

    def dequantized_modules(self, path: Path):
        for module, gq in unpack(gguf_file_in(Path(path))).items():
            yield module, gq.dequantize()

    pack = staticmethod(pack_q4_0)
    unpack_blocks = staticmethod(unpack_q4_0)
    unpack = staticmethod(unpack)
    verify = staticmethod(verify)
    inspect = staticmethod(inspect)
