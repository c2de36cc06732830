"""Opening a GGUF model in llama-cpp-python the same way in every test and benchmark arm.

Run by the llama-cpp-python peer venv's interpreter (it imports nothing of cpu_quant).

On a CPU with AMX, llama.cpp 0.3.36's build (``GGML_NATIVE=ON``) repacks Q4_0 weights into its
AMX buffer type and then crashes with SIGSEGV in the first ``decode`` (measured here on an
Intel Xeon with AMX_INT8, for our Q4_0 file and for llama.cpp's own alike; the bf16 file runs).
This is the upstream fault reported as llama.cpp #20824 ("segfault in
ggml_backend_amx_mul_mat", open) beside #16315 (AMX Q4_0 results wrong). So on such a build
the extra buffer types (weight repacking: AMX, and the CPU repack) are turned off through the
model parameter ``use_extra_bufts``, which is what ``--no-extra-bufts`` does in llama.cpp's
tools; :func:`extra_bufts_off` says whether that happened, and callers record it.
"""

from __future__ import annotations

import llama_cpp

_default_params = llama_cpp.llama_model_default_params


def amx_build() -> bool:
    """Whether this llama.cpp build dispatches to AMX on this CPU (its own system info)."""
    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else str(info)
    return "AMX_INT8 = 1" in info


def extra_bufts_off() -> bool:
    return amx_build()


def _params_without_extra_bufts():
    params = _default_params()
    params.use_extra_bufts = False
    return params


def write_result(out, result: dict) -> None:
    """A pass's JSON result, renamed into place only when whole (``out`` is a Path)."""
    import json
    import os

    result["llama_cpp_python"] = llama_cpp.__version__
    result["extra_bufts_off"] = extra_bufts_off()
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)


def open_model(path: str, **kwargs) -> llama_cpp.Llama:
    """``llama_cpp.Llama(model_path=path, **kwargs)``, with repacking off on an AMX build."""
    if extra_bufts_off():
        import llama_cpp.llama as llama_module

        llama_cpp.llama_model_default_params = _params_without_extra_bufts
        llama_module.llama_cpp.llama_model_default_params = _params_without_extra_bufts
    return llama_cpp.Llama(model_path=path, **kwargs)
