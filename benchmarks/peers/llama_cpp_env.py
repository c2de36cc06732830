"""llama.cpp (through llama-cpp-python 0.3.36) as a peer arm of the runtime benchmark.

PyPI has no binary wheel of llama-cpp-python, only its source, which vendors llama.cpp; so the
harness builds it into its own virtual environment,
``$XDG_CACHE_HOME/cpu-quant/peers/llama-cpp-python-0.3.36`` (``CPU_QUANT_CACHE`` overrides the
cache root, as for the GPTQModel peer), with ``CMAKE_ARGS=-DGGML_NATIVE=ON`` (the kernels for
this CPU's ISA, as a user building llama.cpp here would get them). About 8 minutes on 2 cores.
The venv is built in ``DIR.partial`` and renamed into place when complete; ``READY`` records the
versions and the build flags.

The same source holds llama.cpp's converter, ``convert_hf_to_gguf.py`` with its ``gguf-py`` and
``conversion`` packages; they are unpacked into ``DIR/llama.cpp``. ``gguf_files(src, types)``
converts a Hugging Face checkpoint to a bf16 GGUF (run by *our* interpreter, which has torch and
transformers) and quantizes it to each of ``types`` with ``llama_model_quantize`` (run by the
peer's), cached next to the checkpoint's other artifacts.

One departure from a plain conversion: the converter identifies a BPE tokenizer by hashing how it
splits a test string and refuses one it does not know. The benchmark's 0.5B model is a random
Qwen2 carrying the demo model's tokenizer, a pairing no real checkpoint has; the runtime arms
feed token ids, never text, so the pre-tokenizer is declared ``qwen2`` (recorded in the file's
metadata; speed does not depend on it).

``install_tools()`` builds llama.cpp's own command-line tools from the same vendored source
(``llama-imatrix``, ``llama-quantize``, ``llama-perplexity``: the importance matrix is a C++
pointer in ``llama_model_quantize_params``, so only the tools can apply it) into
``$CACHE/peers/llama.cpp-tools-0.3.36/bin``, statically linked, with the venv's ``GGML_NATIVE``
build; staged in ``DIR.partial`` and renamed into place like the venv.

``python -m benchmarks.peers.llama_cpp_env`` installs (or reports) the venv;
``python -m benchmarks.peers.llama_cpp_env --tools`` the tools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from .gptqmodel_env import (
    PeerEnv,
    PeerInstallError,
    _base_python,
    _run,
    build_staged,
    cache_root,
    peer_main,
)

VERSION = "0.3.36"
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
PASS_SCRIPT = Path(__file__).with_name("llama_cpp_pass.py")
# llama.cpp's file types (llama.h, enum llama_ftype) for the types the benchmark offers
FTYPES = {"q4_0": 2, "q4_k_m": 15, "q8_0": 7}
CONVERT_PRE_TOKENIZER = "qwen2"
TOOLS = ("llama-imatrix", "llama-quantize", "llama-perplexity")
TOOLS_CMAKE_ARGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release")


def venv_dir() -> Path:
    return cache_root() / "peers" / f"llama-cpp-python-{VERSION}"


def ready_env() -> PeerEnv | None:
    root = venv_dir()
    marker = root / "READY"
    if not marker.is_file() or not (root / "bin" / "python").exists():
        return None
    return PeerEnv(root, root / "bin" / "python", json.loads(marker.read_text()))


def _unpack_converter(sdist: Path, dst: Path) -> None:
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "gguf-py/", "conversion/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted)
                   and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(dst, members=members, filter="data")
    if not (dst / "convert_hf_to_gguf.py").is_file():
        raise PeerInstallError(f"{sdist.name} holds no convert_hf_to_gguf.py")


def install(force: bool = False) -> PeerEnv:
    """Build the llama-cpp-python venv from its source (minutes; network to PyPI); idempotent."""
    existing = ready_env()
    if existing is not None and not force:
        return existing
    root = venv_dir()
    log_path = root.with_name(root.name + ".install.log")

    def build(staging: Path, log) -> dict:
        _run([_base_python(), "-m", "venv", str(staging)], log)
        py = str(staging / "bin" / "python")
        sdist_dir = staging / "sdist"
        _run([py, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
              "--no-binary", ":all:", "-d", str(sdist_dir), f"llama-cpp-python=={VERSION}"], log)
        sdist = next(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS,
               "CMAKE_BUILD_PARALLEL_LEVEL": str(len(os.sched_getaffinity(0)))}
        cmd = [py, "-m", "pip", "install", "--disable-pip-version-check", str(sdist)]
        print("+ " + " ".join(cmd), file=log, flush=True)
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode:
            raise PeerInstallError(f"building llama-cpp-python {VERSION} failed; see {log_path}")
        _unpack_converter(sdist, staging / "llama.cpp")
        sdist.unlink()
        out = subprocess.run([py, "-c", "import llama_cpp, json; print(json.dumps("
                              "{'llama_cpp_python': llama_cpp.__version__, "
                              "'system_info': llama_cpp.llama_print_system_info().decode()}))"],
                             capture_output=True, text=True)
        if out.returncode:
            raise PeerInstallError(f"llama_cpp does not import: {out.stderr.strip()[-300:]}")
        return {**json.loads(out.stdout.strip().splitlines()[-1]), "cmake_args": CMAKE_ARGS}

    build_staged(root, build, log_path)
    env = ready_env()
    assert env is not None
    return env


def tools_dir() -> Path:
    return cache_root() / "peers" / f"llama.cpp-tools-{VERSION}"


def ready_tools() -> PeerEnv | None:
    """The built tools (``env.path / "bin" / NAME``), or None; ``python`` is unused."""
    root = tools_dir()
    marker = root / "READY"
    if not marker.is_file() or not all((root / "bin" / t).is_file() for t in TOOLS):
        return None
    return PeerEnv(root, root / "bin" / TOOLS[0], json.loads(marker.read_text()))


def install_tools(force: bool = False) -> PeerEnv:
    """Build llama.cpp's imatrix/quantize/perplexity tools from the sdist (minutes); idempotent."""
    import shutil

    existing = ready_tools()
    if existing is not None and not force:
        return existing
    root = tools_dir()
    log_path = root.with_name(root.name + ".install.log")

    def build(staging: Path, log) -> dict:
        sdist_dir = staging / "sdist"
        _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
              "--no-deps", "--no-binary", ":all:", "-d", str(sdist_dir),
              f"llama-cpp-python=={VERSION}"], log)
        sdist = next(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        src = staging / "llama.cpp"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(src, members=[m for m in members if m.name], filter="data")
        jobs = str(len(os.sched_getaffinity(0)))
        _run(["cmake", "-S", str(src), "-B", str(staging / "build"), "-G", "Ninja",
              *TOOLS_CMAKE_ARGS], log)
        _run(["cmake", "--build", str(staging / "build"), "-j", jobs, "--target", *TOOLS], log)
        (staging / "bin").mkdir()
        for t in TOOLS:
            shutil.copy2(staging / "build" / "bin" / t, staging / "bin" / t)
        shutil.rmtree(staging / "build")
        shutil.rmtree(sdist_dir)
        out = subprocess.run([str(staging / "bin" / "llama-quantize"), "--help"],
                             capture_output=True, text=True)
        return {"llama_cpp_python_sdist": VERSION, "tools": list(TOOLS),
                "cmake_args": list(TOOLS_CMAKE_ARGS),
                "quantize_help_head": (out.stdout + out.stderr).strip().splitlines()[:2]}

    build_staged(root, build, log_path)
    env = ready_tools()
    if env is None:
        raise PeerInstallError(f"the tools are not where they were built; see {log_path}")
    return env


_CONVERT = """
import runpy, sys
from pathlib import Path
script = Path(sys.argv[1])
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
import conversion.base as base
pre_tokenizer = sys.argv[2]
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer
sys.argv = [str(script), *sys.argv[3:]]
runpy.run_path(str(script), run_name="__main__")
"""

_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def _atomic(dst: Path, make) -> Path:
    if dst.is_file():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    tmp.unlink(missing_ok=True)
    make(tmp)
    os.replace(tmp, dst)
    return dst


def gguf_files(env: PeerEnv, src: Path, workdir: Path, types: list[str]) -> dict[str, Path]:
    """``{type: GGUF path}`` for ``src``, converted (bf16) and quantized once, then cached."""
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        raise ValueError(f"unknown llama.cpp type(s) {', '.join(unknown)}; known: "
                         f"{', '.join(FTYPES)}")
    workdir.mkdir(parents=True, exist_ok=True)
    converter = env.path / "llama.cpp" / "convert_hf_to_gguf.py"

    def convert(tmp: Path) -> None:
        cmd = [sys.executable, "-c", _CONVERT, str(converter), CONVERT_PRE_TOKENIZER, str(src),
               "--outtype", "bf16", "--outfile", str(tmp)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise PeerInstallError(f"convert_hf_to_gguf failed: {out.stderr.strip()[-400:]}")

    bf16 = _atomic(workdir / f"{src.name}-bf16.gguf", convert)
    files = {}
    for t in types:
        def quantize(tmp: Path, t=t) -> None:
            cmd = [str(env.python), "-c", _QUANTIZE, str(bf16), str(tmp), str(FTYPES[t]),
                   str(len(os.sched_getaffinity(0)))]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise PeerInstallError(f"llama_model_quantize to {t} failed: "
                                       f"{out.stderr.strip()[-400:]}")

        files[t] = _atomic(workdir / f"{src.name}-{t}.gguf", quantize)
    return files


def main() -> int:
    if "--tools" in sys.argv:
        sys.argv.remove("--tools")
        return peer_main(__doc__.splitlines()[0], install_tools)
    return peer_main(__doc__.splitlines()[0], install)


if __name__ == "__main__":
    raise SystemExit(main())
