"""The ``gguf`` format in the registry, and the command line llama.cpp's tools need to run its
files."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path
from typing import ClassVar

import gguf

from ...core.block_grid import BlockGrid
from ...core.errors import CpuQuantError
from ...core.experts import refuse_experts
from ...core.findings import Finding
from ..base import Format, Limits, Serving
from .architectures import arch_spec
from .block_types import QUANT_TYPES
from .mix import IQ4_NL, Q4_K_M, Q4_K_S, FileType, TensorFacts, chosen_type
from .q4_0 import BLOCK, pack_q4_0, unpack_q4_0
from .reader import (
    _open,
    gguf_file_in,
    head_is_token_embd,
    inspect,
    quantized_types,
    unpack,
    verify,
)
from .sink import GGUFSink
from .vision import (
    inspect_mmproj,
    language_config,
    language_name,
    mmproj_file_in,
    mmproj_tensors,
    processor_config,
    refuse_vision,
    verify_mmproj,
    vision_gguf,
)

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

MMPROJ_WHY = ("A vision-language model runs from two files: the language model's GGUF (its "
              "linears 4-bit) and the projector file `mmproj-*.gguf` (the vision tower and the "
              "projector, unquantized), which llama.cpp's multimodal tools take as `--mmproj`.")


class GGUFFormat(Format, name="gguf"):
    """llama.cpp's GGUF with Q4_0 linears (see the module docstring for the layout)."""

    summary = "llama.cpp, Q4_0"
    file_suffix: ClassVar[str] = "-Q4_0.gguf"  # <model><suffix>
    llama_file_type: ClassVar[gguf.LlamaFileType] = gguf.LlamaFileType.MOSTLY_Q4_0

    limits = Limits(groups=(128, 64, 32), row_group=True, k_multiple=BLOCK, n_multiple=1,
                    stores_zeros=False, kernel="llama.cpp Q4_0")

    def __init__(self, pre_tokenizer: str | None = None) -> None:
        self.pre_tokenizer = pre_tokenizer

    def serving(self, target: Path) -> Serving:
        model = gguf_file_in(Path(target)) or Path(target)  # the model file of a directory
        mmproj = mmproj_file_in(model.parent) if model.is_file() else None
        if mmproj is None:
            return Serving("llama.cpp", shlex.join(llama_cpp_command("llama-cli", model)),
                           (NO_REPACK_WHY,))
        return Serving("llama.cpp", shlex.join(llama_cpp_command(
            "llama-mtmd-cli", model, "--mmproj", mmproj, "--image", "IMAGE.jpg", "-p",
            "Describe this image.")), (MMPROJ_WHY, NO_REPACK_WHY))

    def refuse_source(self, source_config: dict) -> str | None:
        """Why a model with this config.json cannot be written as GGUF (checked before work)."""
        if why := refuse_vision(source_config):
            return why
        try:
            arch_spec(language_config(source_config))
        except CpuQuantError as e:
            return str(e)
        return None

    def refuse_source_files(self, source: Path, source_config: dict) -> str | None:
        """A vision-language model's projector file needs its image processor's settings."""
        if vision_gguf(source_config) is None:
            return None
        try:
            processor_config(source)
        except CpuQuantError as e:
            return str(e).removeprefix("gguf: ")
        return None

    def open_sink(self, directory: Path, n_layers: int, resume_state: dict | None) -> GGUFSink:
        return GGUFSink(self, directory, n_layers, resume_state)

    def owns(self, path: Path) -> bool:
        return gguf_file_in(Path(path)) is not None

    def verify_artifact(self, path: Path) -> tuple[list[Finding], int]:
        file = gguf_file_in(Path(path))
        reader = _open(file)
        quantized = sum(t.tensor_type in quantized_types() and (
            t.name != "token_embd.weight" or head_is_token_embd(reader))
            for t in reader.tensors)  # the linears and the head
        mmproj = mmproj_file_in(file.parent)
        return verify(file) + (verify_mmproj(mmproj) if mmproj else []), quantized

    def inspect_artifact(self, path: Path) -> dict:
        file = gguf_file_in(Path(path))
        mmproj = mmproj_file_in(file.parent)
        return {**inspect(file), **({"mmproj": inspect_mmproj(mmproj)} if mmproj else {})}

    def kept_tensors(self, path: Path, source_config: dict, names: list[str]):
        mmproj = mmproj_file_in(gguf_file_in(Path(path)).parent)
        if mmproj is None:
            yield from ((n, None) for n in names)
            return
        yield from mmproj_tensors(mmproj, source_config, names)

    def dequantized_modules(self, path: Path):
        for module, gq in unpack(gguf_file_in(Path(path))).items():
            yield module, gq.dequantize()

    pack = staticmethod(pack_q4_0)
    unpack_blocks = staticmethod(unpack_q4_0)
    unpack = staticmethod(unpack)
    verify = staticmethod(verify)
    inspect = staticmethod(inspect)


class GGUFTypeMixFormat(GGUFFormat):
    """A GGUF of one of llama.cpp's file types (:attr:`file_type`): every tensor on the type
    ``llama-quantize`` gives it (``mix.py``), the linears GPTQ-quantized on that type's grid.
    Its grids are its own, so it is written in a run of its own."""

    file_type: ClassVar[FileType]
    own_grids = True
    # the run's group is not what these files store (each tensor takes its type's blocks), so
    # any group is accepted; K a multiple of 32, the smallest block of every type here
    limits = Limits(groups=(128, 64, 32), row_group=True, k_multiple=32, n_multiple=1,
                    stores_zeros=False, kernel="llama.cpp")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.summary = f"llama.cpp, {cls.file_type.name}"
        cls.file_suffix = f"-{cls.file_type.name}.gguf"
        cls.llama_file_type = cls.file_type.llama_file_type

    def refuse_source(self, source_config: dict) -> str | None:
        why = refuse_experts(source_config, f"{self.name} has no type mix for stacked experts "
                                            "here (llama.cpp's ffn_*_exps rules are not "
                                            "ported); write --format gguf (Q4_0)")
        return why or super().refuse_source(source_config)

    def ties_head(self, source_config: dict) -> bool:
        """A tied source's file is tied, as ``llama-quantize``'s: the GPTQ-quantized head, on
        the type llama.cpp gives a tied ``token_embd``, is the one ``token_embd``."""
        return bool(language_config(source_config).get("tie_word_embeddings", False))

    def tensor_type(self, module: str, in_features: int, source_config: dict,
                    calibrated: bool) -> gguf.GGMLQuantizationType:
        """The ggml type of the tensor of HF module ``module`` in this file type."""
        return chosen_type(self.file_type, tensor_facts(module, in_features, source_config,
                                                        calibrated))

    def tensor_grid(self, module: str, in_features: int, source_config: dict,
                    calibrated: bool) -> BlockGrid:
        return QUANT_TYPES[self.tensor_type(module, in_features, source_config, calibrated)].grid


class GGUFQ4KMFormat(GGUFTypeMixFormat, name="gguf:q4_k_m"):
    file_type = Q4_K_M


class GGUFQ4KSFormat(GGUFTypeMixFormat, name="gguf:q4_k_s"):
    file_type = Q4_K_S


class GGUFIQ4NLFormat(GGUFTypeMixFormat, name="gguf:iq4_nl"):
    file_type = IQ4_NL


@functools.lru_cache(maxsize=8)
def _tensor_name_map(arch: gguf.MODEL_ARCH, n_layers: int) -> gguf.TensorNameMap:
    """gguf-py's HF -> GGUF name map (building one takes a while: asked once per tensor)."""
    return gguf.get_tensor_name_map(arch, n_layers)


def tensor_facts(module: str, in_features: int, cfg: dict, calibrated: bool) -> TensorFacts:
    """What llama.cpp's type choice sees of the tensor of HF module ``module`` (a linear,
    ``lm_head`` or the embedding); a vision-language model's decoder as a decoder-only one."""
    module, cfg = language_name(cfg, module), language_config(cfg)
    spec = arch_spec(cfg)
    n_layers = int(cfg["num_hidden_layers"])
    name = _tensor_name_map(spec.arch, n_layers).get_name(module + ".weight",
                                                          try_suffixes=(".weight",))
    if name is None:
        raise CpuQuantError(f"gguf: {module} has no {spec.name} tensor name in llama.cpp")
    m = re.match(r"blk\.(\d+)\.", name)
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    return TensorFacts(name, in_features, int(m.group(1)) if m else -1, n_layers, heads // kv,
                       bool(cfg.get("tie_word_embeddings", False)), calibrated)
