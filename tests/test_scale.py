"""A model of a size users quantize, end to end: Llama-3.2-1B's exact shapes (random weights,
``cpu_quant.models.shapes``) quantized by `cpu-quant gptq` with the default settings and served
by the real vLLM with the kernel this CPU's row of the kernel table names.

Random weights make fidelity meaningless; what is checked is that every stage works at this
size and that vLLM computes the artifact's own weights. The calibration is smaller than the
default's (4 x 512 tokens, fewer than the down projections' 8,192 input columns, so their
Hessians are rank-deficient, as a short calibration's are); every other setting is the default
(group 128, the head in groups of 32, the down projections in groups of 64, smoothing, scale
search, static-group act-order).

A random model's next-token distribution is flat (logits of standard deviation about 0.9 over
128,256 tokens): its top-2 margin is within a near-tie at most steps, so comparing greedy
tokens alone would pass for almost any weights. The test scores vLLM's tokens with the torch
model of the dequantized weights, teacher-forced: every token vLLM chose must be within the
path's near-tie of the torch model's best at that position. Where the torch model's best is
clear of the near-tie, that is equality, so this is the greedy comparison of the smaller
models' tests, step by step from vLLM's own context, in one forward pass per prompt instead
of a generation of the torch model (on a CPU without native bf16, 48 decode steps of the 1B
reference were most of this test's time). A misread checkpoint fails at once: its choices are
random tokens for the reference, nats below its best.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cpu_quant.eval.dequantized import load_model
from cpu_quant.models.shapes import SHAPES, random_model_path

from .conftest import build_once, needs_vllm_gptq_kernel, run_cli
from .helpers.vllm_paths import NEAR_TIE_NATS, reference_context, vllm_gptq_path
from .test_gptq_end_to_end import NEW_TOKENS, _vllm_greedy

pytestmark = pytest.mark.e2e  # writes a 2.5 GB checkpoint and quantizes it

MODEL = "Llama-3.2-1B"
CALIB = ["--samples", "4", "--seqlen", "512"]
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 5215, 2006, 3090, 30, 28, 2438, 3781, 28]]


@pytest.fixture(scope="session")
def random_1b() -> Path:
    return random_model_path(MODEL, progress=False)


@pytest.fixture(scope="session")
def gptq_1b(random_1b: Path, artifacts_dir: Path) -> Path:
    dst = artifacts_dir / "llama32-1b-random-gptq"
    return build_once(dst, lambda: run_cli("gptq", str(random_1b), str(dst), *CALIB, "--no-eval",
                                           timeout=3600))


def test_the_random_model_has_the_public_shapes(random_1b: Path):
    cfg = json.loads((random_1b / "config.json").read_text())
    shape = SHAPES[MODEL]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (2048, 8192, 16, 8, 128256)
    index = json.loads((random_1b / "model.safetensors.index.json").read_text())
    norms = (2 * shape.layers + 1) * shape.hidden  # two per layer and the final one
    assert index["metadata"]["total_size"] == 2 * (shape.parameters() + norms)


@pytest.mark.slow
def test_default_build_of_a_1b_model_is_whole(gptq_1b: Path):
    cfg = json.loads((gptq_1b / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["bits"] == 4 and q["sym"] and q["group_size"] == 128 and q["lm_head"]
    assert cfg["tie_word_embeddings"] is False  # the head untied, quantized
    report = json.loads((gptq_1b / "quantization_report.json").read_text())
    assert len(report["tensors"]) == 16 * 7 + 1 and report["head_quantized"]
    assert report["calibration_tokens"] == int(CALIB[1]) * int(CALIB[3])
    proc = run_cli("verify", str(gptq_1b))
    assert "ERROR" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.vllm
@needs_vllm_gptq_kernel
def test_vllm_serves_a_1b_model_like_its_dequantized_weights(gptq_1b: Path, tmp_path: Path):
    path = vllm_gptq_path()
    results, log = _vllm_greedy(gptq_1b, PROMPTS, tmp_path, plugins=None)
    assert "gptq" in log.lower()
    reference = load_model(gptq_1b, torch.bfloat16)
    near_tie = NEAR_TIE_NATS[path]
    for prompt, res in zip(PROMPTS, results, strict=True):
        ids = torch.tensor([prompt + res["tokens"]])
        with torch.no_grad(), reference_context(reference, path):
            logp = reference(input_ids=ids).logits[0].float().log_softmax(-1)
        steps = logp[len(prompt) - 1:-1]  # the distribution each generated token came from
        chosen = steps.gather(1, torch.tensor(res["tokens"])[:, None])[:, 0]
        shortfall = steps.max(-1).values - chosen
        assert len(res["tokens"]) == NEW_TOKENS
        assert float(shortfall.max()) < near_tie, shortfall.tolist()
