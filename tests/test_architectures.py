"""The layer-streaming driver on every decoder-only architecture we claim, with tiny random models.

No registry ships real Mistral, Qwen2/3, Gemma 2/3 or Phi-3 weights, so these use tiny random
models of each architecture (unit level). The demo model covers Llama end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpu_quant.eval.dequantized import load_model
from cpu_quant.io.checkpoint import open_checkpoint
from cpu_quant.quantize.gptq_cpu_export import GPTQLayout
from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint
from cpu_quant.quantize.streaming import LayerStream

from .conftest import TINY_ARCHS, make_tiny_model


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def tiny_model(request, demo_src, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_model(arch, tmp_path_factory.mktemp(arch) / "src", demo_src)


@torch.no_grad()
def test_streaming_reproduces_the_full_model(tiny_model):
    """Layer by layer through the recorded call arguments == the model's own forward."""
    from transformers import AutoModelForCausalLM

    arch, path = tiny_model
    ids = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    expected = full(input_ids=ids, use_cache=False).logits.float()

    stream = LayerStream(open_checkpoint(path))
    hidden = stream.capture([ids])
    for i in range(stream.n_layers):
        stream.load_layer(i)
        hidden = list(stream.forward_layer(i, hidden))
        stream.unload_layer(i)
    head = full.get_output_embeddings()
    got = head(stream.final_norm()(hidden[0]))
    softcap = getattr(full.config, "final_logit_softcapping", None)
    if softcap:  # Gemma 2 caps its logits in the model's dtype, after the head
        got = torch.tanh(got / softcap) * softcap
    got = got.float()
    assert torch.equal(got, expected), f"{arch}: max diff {(got - expected).abs().max()}"


def test_quantized_model_stays_close(tiny_model, tmp_path):
    arch, path = tiny_model
    dst = tmp_path / "q"
    settings = QuantSettings(method="gptq", group_size=32, samples=4, seqlen=64, batch_size=2)
    report = quantize_checkpoint(path, dst, settings, GPTQLayout(), progress=False)
    linears_per_layer = 4 if arch == "phi3" else 7  # Phi-3 ships fused qkv_proj and gate_up_proj
    assert report.head_quantized and len(report.tensors) == 2 * linears_per_layer + 1
    ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(1))
    ref = load_model(path)(input_ids=ids).logits
    quant = load_model(dst)(input_ids=ids).logits
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), quant.flatten(), dim=0)
    # 4-bit weights on random tiny models: measured cosine ~0.99; 0.95 catches a wrong layout
    assert cos > 0.95, f"{arch}: cosine {cos:.3f}"
