"""Shared fixtures (the real demo model, a real `cpu-quant gptq` artifact, tiny random models)
and the two test tiers.

* The unit tier, what ``pytest`` runs with no arguments: math, layouts, plans, CLI argument
  errors, tiny random models, the real demo model only where reading it is the point.
* The end-to-end tier, ``pytest -m e2e``: the real vLLM, ExecuTorch, llama.cpp and GPTQModel,
  and real quantizations of the demo model. A test is in it when it is marked ``e2e``,
  ``vllm`` or ``slow``, or when it uses one of the fixtures in :data:`E2E_FIXTURES` (they
  quantize the demo model or start a runtime; each is built once per run and shared).

``pytest -m "e2e or not e2e"`` runs both in one process. CI runs each tier on two
pytest-xdist workers (``-n 2``; the end-to-end tier with ``--dist loadgroup``, which with no
``xdist_group`` marks hands out one test at a time); a session fixture is built once per
worker that needs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "cpu_quant.cli"]
# Small calibration for CI; the benchmarks use the full 128 x 512.
SMALL_CALIB = ["--samples", "16", "--seqlen", "256"]


# Fixtures that quantize the demo model or start a real runtime: a test using any of them (even
# through another fixture) belongs to the end-to-end tier.
E2E_FIXTURES = frozenset({
    "demo_formats", "gptq_artifact", "rtn_search_artifact", "asym_artifact", "sym_artifact",
    "uniform_artifact", "peer", "engines", "served_artifact", "vllm_run", "isa_results", "xnnpack_8da8w",
    "qnn_w8a16", "qnn_16a4w", "xnnpack_8da4w", "tiny_gptq", "demo_gptq_g32", "quantize_dir",
    "quantize_result", "fidelity_result", "stream_and_hidden",
})
E2E_MARKS = ("e2e", "vllm", "slow")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if any(item.get_closest_marker(m) for m in E2E_MARKS) or E2E_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.e2e)


def vllm_gptq_unavailable() -> str | None:
    """Why vLLM with the cpu_quant plugin (installed with cpu-quant) cannot run a GPTQ checkpoint
    on this CPU, or None: the product's own check on /proc/cpuinfo (its kernel table puts GPTQ
    layers on tinygemm on x86 with AVX2 or AVX-512, so only stock vLLM's limits remain
    elsewhere)."""
    from cpu_quant.probe import read_machine
    from cpu_quant.probe import vllm_gptq_unavailable as why

    return why(read_machine())


def stock_vllm_gptq_unavailable() -> str | None:
    """Why stock vLLM (no cpu_quant plugin, or its GPTQ kernel switched off) cannot run a GPTQ
    checkpoint on this CPU (no AVX-512: its AVX2 kernel library lacks cpu_gemm_wna16), or None."""
    from cpu_quant.probe import read_machine
    from cpu_quant.probe import stock_vllm_gptq_unavailable as why

    return why(read_machine())


# vLLM serving a GPTQ checkpoint as users run it (the plugin installed): skipped, with the
# reason, only where neither vLLM's build nor the plugin's kernel can run it.
needs_vllm_gptq_kernel = pytest.mark.skipif(vllm_gptq_unavailable() is not None,
                                            reason=f"{vllm_gptq_unavailable()}")
# stock vLLM's own GPTQ kernel (tests that compare against it or exclude the plugin)
needs_stock_vllm_gptq_kernel = pytest.mark.skipif(stock_vllm_gptq_unavailable() is not None,
                                                  reason=f"{stock_vllm_gptq_unavailable()}")


def run_cli(*args: str, check: bool = True, timeout: int = 1800, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"cpu-quant {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def demo_src() -> Path:
    from cpu_quant.models.demo import demo_model_path

    return demo_model_path()


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def demo_formats(demo_src: Path, artifacts_dir: Path) -> Path:
    """The real main job writing every format from one calibrated run (GPTQ, group 128, head
    quantized, small calibration): ``DIR/gptq``, ``DIR/cpu_int4``, ``DIR/gguf``. The one
    quantization of the demo model that the end-to-end tier shares."""
    dst = artifacts_dir / "demo-formats"
    run_cli("gptq", str(demo_src), str(dst), "--group", "128", *SMALL_CALIB, "--no-eval",
            "--format", "gptq,cpu_int4,gguf")
    return dst


@pytest.fixture(scope="session")
def gptq_artifact(demo_formats: Path) -> Path:
    """The main job's GPTQ checkpoint (see ``demo_formats``)."""
    return demo_formats / "gptq"


@pytest.fixture(scope="session")
def rtn_plain_artifact(demo_src: Path, artifacts_dir: Path) -> Path:
    dst = artifacts_dir / "demo-rtn-plain"
    run_cli("gptq", str(demo_src), str(dst), "--method", "rtn", "--calib", "none",
            "--no-scale-search", "--no-eval")
    return dst


@pytest.fixture(scope="session")
def rtn_search_artifact(demo_src: Path, artifacts_dir: Path) -> Path:
    dst = artifacts_dir / "demo-rtn-search"
    run_cli("gptq", str(demo_src), str(dst), "--method", "rtn", *SMALL_CALIB, "--no-eval")
    return dst


def tokenizer_files(demo_src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_src / name).exists():
            shutil.copy(demo_src / name, dst / name)


TINY_ARCHS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16,
                                    "sliding_window": 64}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
}


def make_tiny_model(arch: str, dst: Path, demo_src: Path, seed: int = 0, vocab: int = 49152) -> Path:
    """A tiny random decoder-only model of ``arch`` saved as bf16 safetensors + the demo tokenizer."""
    import torch
    import transformers

    cls_name, extra = TINY_ARCHS[arch]
    cfg_cls = getattr(transformers, cls_name)
    kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True)
    kwargs.update(extra)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    tokenizer_files(demo_src, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_llama(demo_src: Path, tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", demo_src)


@pytest.fixture(scope="session")
def hostile_bases(tiny_llama, tmp_path_factory):
    """The hostile-input corpus' base inputs (tests/hostile/generate.py): the tiny model,
    another of its shapes, its GPTQ, cpu_int4 and GGUF artifacts (RTN), a run interrupted
    after its first layer, and a short calibration text. Built in-process, once."""
    from .hostile.generate import build_bases

    return build_bases(tmp_path_factory.mktemp("hostile-bases"), model=tiny_llama)


def put_nan(checkpoint: Path, tensor: str, index: tuple[int, int]) -> None:
    """Write one NaN into ``tensor`` of a one-file checkpoint (``model.safetensors``)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    w = tensors[tensor].clone()
    w[index] = float("nan")
    tensors[tensor] = w
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
