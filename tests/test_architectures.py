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


@torch.no_grad()
def test_hessian_pass_stops_early_without_changing_the_hessians(tiny_model):
    """Batches after the first end once every linear has seen its input (down_proj's product
    is skipped); the Hessians equal those of full forwards, and the early stop really fires."""
    from cpu_quant.quantize.pipeline import HessianAccumulator

    arch, path = tiny_model
    stream = LayerStream(open_checkpoint(path))
    gen = torch.Generator().manual_seed(2)
    hidden = stream.capture([torch.randint(0, 49152, (2, 32), generator=gen) for _ in range(3)])
    stream.load_layer(0)
    linears = stream.linears(0)

    full = HessianAccumulator(linears)
    for _ in stream.forward_layer(0, hidden):
        pass
    full.close()

    early = HessianAccumulator(linears)
    completed = []
    stream.observe_layer(0, hidden, early.begin_batch, lambda: (completed.append(1), early.end_batch()))
    early.close()

    assert len(completed) == 1, f"{arch}: {len(completed)} of 3 batches ran to the end"
    assert set(early.h) == set(full.h) == set(linears)
    for name in linears:
        assert early.count[name] == full.count[name]
        assert torch.equal(early.hessian(name), full.hessian(name)), name
