"""The main job end to end on the real demo model: `cpu-quant gptq`, real vLLM, `cpu-quant eval`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_quant.core.io.checkpoint import open_checkpoint
from cpu_quant.core.naming import group_for_module
from cpu_quant.eval.dequantized import load_model
from cpu_quant.eval.fidelity import EvalSettings, _greedy, evaluate_artifact
from cpu_quant.formats.gptq.layout import dequantize_gptq, unpack_gptq_qzeros
from cpu_quant.quantize.plan import DOWN_GROUP

from .conftest import REPO, needs_stock_vllm_gptq_kernel, read_config
from .helpers.vllm_paths import NEAR_TIE_NATS, reference_context, stock_vllm_gptq_path

PROMPTS = [
    "The capital of France is",
    "Emma Woodhouse, handsome, clever, and rich,",
    "def fibonacci(n):",
    "It is a truth universally acknowledged that",
]
NEW_TOKENS = 24


def test_config_describes_a_vllm_cpu_checkpoint(gptq_artifact: Path):
    cfg = read_config(gptq_artifact)
    q = cfg["quantization_config"]
    assert q["quant_method"] == "gptq" and q["bits"] == 4 and q["sym"] is True
    assert q["desc_act"] is False and q["checkpoint_format"] == "gptq"
    assert q["group_size"] == 128 and q["lm_head"] is True
    assert cfg["tie_word_embeddings"] is False
    # hidden size 576 is not divisible by 128: those modules carry a group-64 override, in
    # both HF names and vLLM's fused names; the down projections take groups of 64 by default
    assert group_for_module(q["dynamic"], "model.layers.3.self_attn.qkv_proj", 128) == 64
    assert group_for_module(q["dynamic"], "model.layers.3.mlp.gate_up_proj", 128) == 64
    assert group_for_module(q["dynamic"], "model.layers.3.self_attn.q_proj", 128) == 64
    assert group_for_module(q["dynamic"], "model.layers.3.mlp.down_proj", 128) == DOWN_GROUP
    # the head: groups of 32, calibrated GPTQ's default for it (plan.HEAD_GROUP)
    assert group_for_module(q["dynamic"], "lm_head", 128) == 32
    report = json.loads((gptq_artifact / "quantization_report.json").read_text())
    assert len(report["tensors"]) == 30 * 7 + 1
    assert report["head_quantized"] is True
    # 4-bit codes and a bf16 scale per group: 4.25 bits in groups of 64, 4.5 for the head's 32
    weights = sum(math.prod(t["shape"]) for t in report["tensors"])
    bits = sum(math.prod(t["shape"]) * (4 + 16 / t["group_size"]) for t in report["tensors"])
    assert report["bits_per_weight"] == pytest.approx(bits / weights, abs=1e-4)
    assert 4.25 < report["bits_per_weight"] < 4.5
    assert all(t["damp"] is not None for t in report["tensors"])
    assert report["provenance"]["torch"].startswith("2.13")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (gptq_artifact / name).is_file()


def test_tensors_agree_with_config(gptq_artifact: Path):
    ckpt = open_checkpoint(gptq_artifact)
    q = ckpt.config["quantization_config"]
    names = set(ckpt.names)
    assert "lm_head.qweight" in names and "lm_head.weight" not in names
    assert "model.embed_tokens.weight" in names and ckpt.dtype("model.embed_tokens.weight") == "BF16"
    for mod in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj", "lm_head"):
        k8, n = ckpt.shape(f"{mod}.qweight")
        g = group_for_module(q["dynamic"], mod, q["group_size"])
        assert ckpt.shape(f"{mod}.scales") == (k8 * 8 // g, n)
        assert ckpt.dtype(f"{mod}.scales") == "BF16"
        g_idx = ckpt.tensor(f"{mod}.g_idx")
        assert torch.equal(g_idx, torch.arange(k8 * 8, dtype=torch.int32) // g)
        assert torch.all(unpack_gptq_qzeros(ckpt.tensor(f"{mod}.qzeros")) == 7)  # v1: z - 1


def test_packing_round_trips_through_vllm_unpacking(gptq_artifact: Path):
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    ckpt = open_checkpoint(gptq_artifact)
    mod = "model.layers.5.mlp.gate_proj"
    qweight, scales = ckpt.tensor(f"{mod}.qweight"), ckpt.tensor(f"{mod}.scales")
    # vLLM's own unpacking, then its uint4b8 convention (bias 8, qzeros ignored)
    codes = unpack_quantized_values_into_int32(qweight, scalar_types.uint4b8, 0)  # [K, N]
    k, n = codes.shape
    g = k // scales.shape[0]
    vllm_w = ((codes.float() - scalar_types.uint4b8.bias) * scales.float().repeat_interleave(g, 0)).t()
    ours = dequantize_gptq(qweight, ckpt.tensor(f"{mod}.qzeros"), scales, ckpt.tensor(f"{mod}.g_idx"))
    assert torch.equal(vllm_w, ours)


def _vllm_greedy(model_dir: Path, prompts: list[list[int]], tmp_path: Path,
                 plugins: str | None = "stock-only", env: dict | None = None,
                 extra_args: tuple[str, ...] = (), clean_env: dict | None = None
                 ) -> tuple[list[dict], str]:
    """Greedy tokens from real vLLM in a fresh process (``tests/helpers/vllm_generate.py``).

    ``plugins``: ``VLLM_PLUGINS`` (default: stock vLLM, no general plugin, ours included, may
    touch the load path); None leaves every installed plugin on. ``env`` is added to this
    process's environment; ``clean_env`` replaces it. Returns (results, log)."""
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    base = dict(os.environ) if clean_env is None else dict(clean_env)
    full_env = dict(base, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    if plugins is None:
        full_env.pop("VLLM_PLUGINS", None)
    else:
        full_env["VLLM_PLUGINS"] = plugins
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "vllm_generate.py"),
                           str(model_dir), str(prompts_file), str(NEW_TOKENS), *extra_args],
                          capture_output=True, text=True, timeout=900, env=full_env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout + proc.stderr


@pytest.mark.vllm
@needs_stock_vllm_gptq_kernel
def test_stock_vllm_serves_the_artifact_like_its_dequantized_weights(gptq_artifact, demo_src,
                                                                      tmp_path):
    """The default build folds activation smoothing into norms and rows only, and puts the head
    in groups of 32 through a ``dynamic`` override: stock vLLM loads the checkpoint as any GPTQ
    one and generates the greedy tokens of its dequantized weights; ``verify --source`` reads
    the source through the same folds and finds every module."""
    from transformers import AutoTokenizer

    from cpu_quant.core.smoothing_factors import load_factors
    from cpu_quant.verify.source import compare_with_source

    assert load_factors(gptq_artifact) is not None
    dynamic = json.loads((gptq_artifact / "config.json").read_text())["quantization_config"]["dynamic"]
    assert [v["group_size"] for k, v in dynamic.items() if "lm_head" in k] == [32], dynamic
    src_norm = open_checkpoint(demo_src).tensor("model.layers.3.input_layernorm.weight")
    art_norm = open_checkpoint(gptq_artifact).tensor("model.layers.3.input_layernorm.weight")
    assert not torch.equal(src_norm, art_norm)  # the fold is really in the checkpoint
    findings, summary = compare_with_source(gptq_artifact, demo_src)
    assert not findings and summary["min_db"] > 6
    tok = AutoTokenizer.from_pretrained(gptq_artifact)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    results, log = _vllm_greedy(gptq_artifact, prompts, tmp_path)
    assert "CPUWNA16LinearKernel" in log  # the 4-bit kernel really ran
    assert "auto_gptq" in log
    # on AMX that is the W4A8 kernel (int8 activations): the reference computes as it does
    _assert_greedy_matches_dequantized(gptq_artifact, prompts, results, stock_vllm_gptq_path())


def _default_gptq_kernel() -> str:
    from cpu_quant.core.cpu import local_cpu
    from cpu_quant.formats.kernels import serving_kernels

    return serving_kernels(local_cpu(), os.environ.get("VLLM_CPU_INT4_W4A8", "1") != "0").gptq_kernel


@pytest.mark.vllm
@pytest.mark.skipif(_default_gptq_kernel() != "tinygemm",
                    reason="this CPU's kernel-table row keeps vLLM's own GPTQ kernel")
def test_default_kernel_serves_the_artifact_on_tinygemm_like_its_dequantized_weights(
        gptq_artifact, tmp_path):
    """The plugin installed and no environment switch of ours set: vLLM serves the GPTQ
    artifact on tinygemm (this CPU's kernel-table row; on AVX2 stock vLLM cannot run it at all).
    Proved by vLLM's log (its kernel choice, the plugin's line per layer type) and by the op's
    per-call count: every one of the 121 quantized linears (30 layers x qkv, o, gate_up, down,
    and the head) went through it once per forward pass, and no call went elsewhere. The engine
    runs in this helper's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a vLLM setting) so that
    the count can be read. Greedy tokens equal those of the torch model of the dequantized
    weights (bf16 activations: the W4A16 tolerance)."""
    from transformers import AutoTokenizer

    from cpu_quant.formats.gptq.vllm_kernel import KNOB_LINE

    tok = AutoTokenizer.from_pretrained(gptq_artifact)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPU_QUANT_PATCH_")}
    env.pop("VLLM_CPU_INT4_W4A8", None)
    results, log = _vllm_greedy(gptq_artifact, prompts, tmp_path, plugins=None,
                                clean_env=dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    assert "cpu_quant patch gptq_tinygemm: applied" in log, log[-3000:]
    assert "Using GptqTinygemmLinearKernel for AutoGPTQLinearMethod" in log, log[-3000:]
    for kind in ("QKVParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear",
                 "ParallelLMHead"):
        assert f"gptq_tinygemm: {kind} {KNOB_LINE}" in log, (kind, log[-3000:])
    assert "-> vLLM's" not in log  # no layer of this artifact needed vLLM's kernel
    info = json.loads(next(ln for ln in log.splitlines() if ln.startswith("INFO {"))[5:])
    calls = info["path_calls"]["generate"]
    linears = 30 * 4 + 1
    total = calls["kernel"] + calls["dequantize"]
    # one forward per generated token (the first one also prefills the prompts)
    assert total == linears * NEW_TOKENS, calls
    assert calls["kernel"] >= linears * (NEW_TOKENS - 1), calls  # decode steps: the kernel
    _assert_greedy_matches_dequantized(gptq_artifact, prompts, results, "w4a16")


def _assert_greedy_matches_dequantized(artifact: Path, prompts: list[list[int]],
                                       results: list[dict], path: str) -> None:
    """vLLM's greedy tokens equal those of a torch model holding the dequantized weights and
    computing as vLLM's kernel ``path`` does, up to the first step whose top-2 margin is within
    that path's near-tie (the rest of the model differs from torch's bf16:
    helpers/vllm_paths.py)."""
    near_tie = NEAR_TIE_NATS[path]
    reference = load_model(artifact, torch.bfloat16)
    for prompt, res in zip(prompts, results, strict=True):
        with reference_context(reference, path):
            expected = _greedy(reference, torch.tensor([prompt]), NEW_TOKENS)[0].tolist()
        got = res["tokens"]
        first_diff = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
        if first_diff is not None:
            margin = res["top2_margin"][first_diff]
            assert margin is not None and margin < near_tie, (
                f"vLLM diverged from the dequantized weights at token {first_diff} with a top-2 "
                f"margin of {margin:.3f} nats: {got} vs {expected}")


@pytest.mark.slow
def test_fidelity_ordering_on_heldout_text(gptq_artifact, rtn_plain_artifact, rtn_search_artifact,
                                           demo_src):
    settings = EvalSettings(windows=8, seqlen=256, prompts=4, new_tokens=8)
    kl = {name: evaluate_artifact(path, demo_src, settings)["weights"].kl_mean
          for name, path in [("gptq", gptq_artifact), ("rtn", rtn_plain_artifact),
                             ("rtn_search", rtn_search_artifact)]}
    assert kl["rtn_search"] < kl["rtn"], kl
    assert kl["gptq"] < kl["rtn_search"], kl
