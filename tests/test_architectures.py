"""The layer-streaming driver on every decoder-only architecture we claim, with tiny random models.

No registry ships real Mistral, Qwen2/3, Gemma 2/3 or Phi-3 weights, so these use tiny random
models of each architecture (unit level). The demo model covers Llama end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpu_quant.core.io.checkpoint import open_checkpoint
from cpu_quant.eval.dequantized import load_model
from cpu_quant.models.tiny import TINY_ARCHS, make_tiny_model
from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint
from cpu_quant.quantize.streaming import LayerStream


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def tiny_model(request, demo_src, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_model(arch, tmp_path_factory.mktemp(arch) / "src", demo_src)


class _RoundBetweenLayers:
    """Forward pre-hook: a decoder layer's input rounded to bf16, as the stream stores it."""

    def __call__(self, module, args, kwargs):
        return (args[0].to(torch.bfloat16).to(args[0].dtype), *args[1:]), kwargs


@torch.no_grad()
@pytest.mark.parametrize("compute", ["bf16", "fp32"])
def test_streaming_reproduces_the_full_model(tiny_model, compute, monkeypatch):
    """Layer by layer through the recorded call arguments == the model's own forward, bit for
    bit, in both compute dtypes (bf16 where the CPU has a native bf16 GEMM, float32 elsewhere;
    the stream stores activations in bf16 between layers, so the float32 reference rounds each
    layer's input to bf16 too)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("CPU_QUANT_COMPUTE_DTYPE", compute)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[compute]
    arch, path = tiny_model
    ids = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))
    full = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    stream = LayerStream(open_checkpoint(path))
    assert stream.compute == dtype
    # the full model's decoder layers and final norm, found by the stream's module names
    norm = stream.final_norm()
    rounded = {n for n, m in stream.model.named_modules()
               if m is norm or any(m is layer for layer in stream.layers)}
    modules = dict(full.named_modules())
    rounding = [modules[n].register_forward_pre_hook(_RoundBetweenLayers(), with_kwargs=True)
                for n in sorted(rounded)] if dtype != torch.bfloat16 else []
    assert dtype == torch.bfloat16 or len(rounding) == stream.n_layers + 1
    try:
        expected = full(input_ids=ids, use_cache=False).logits.float()
    finally:
        for handle in rounding:
            handle.remove()
    del full

    hidden = stream.capture([ids])
    assert hidden[0].dtype == torch.bfloat16
    for i in range(stream.n_layers):
        stream.load_layer(i)
        hidden = list(stream.forward_layer(i, hidden))
        stream.unload_layer(i)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    head = full.get_output_embeddings()
    got = head(stream.final_norm()(hidden[0].to(dtype)))
    softcap = getattr(full.config, "final_logit_softcapping", None)
    if softcap:  # Gemma 2 caps its logits in the model's dtype, after the head
        got = torch.tanh(got / softcap) * softcap
    got = got.float()
    assert torch.equal(got, expected), f"{arch}: max diff {(got - expected).abs().max()}"


def test_quantized_model_stays_close(tiny_model, tmp_path):
    arch, path = tiny_model
    dst = tmp_path / "q"
    settings = QuantSettings(method="gptq", group_size=32, samples=4, seqlen=64, batch_size=2)
    report = quantize_checkpoint(path, dst, settings, progress=False)
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
    from cpu_quant.quantize.hessians import HessianAccumulator

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


@torch.no_grad()
def test_unloading_a_layer_puts_its_own_empty_parameters_back(tiny_model):
    """A layer loaded and unloaded (twice) holds the very parameter objects it started with,
    all empty: no new tensor objects per layer, which would stay allocated for the rest of the
    run wherever malloc put them and fragment the heap with depth (docs/reliability.md)."""
    arch, path = tiny_model
    stream = LayerStream(open_checkpoint(path))
    layer = stream.layers[0]
    before = {n: p for n, p in layer.named_parameters()}
    assert all(p.is_meta for p in before.values())
    for loads in (1, 2):  # the second round loads twice before unloading
        for _ in range(loads):
            stream.load_layer(0)
        loaded = dict(layer.named_parameters())
        assert not any(p.is_meta for p in loaded.values()), arch
        assert all(loaded[n] is not before[n] for n in before)
        stream.unload_layer(0)
        after = dict(layer.named_parameters())
        assert after.keys() == before.keys()
        assert all(after[n] is before[n] for n in before), arch


def test_compute_dtype_follows_the_cpu_and_the_override(monkeypatch):
    from cpu_quant.core.errors import CpuQuantError
    from cpu_quant.quantize.streaming import compute_dtype

    monkeypatch.delenv("CPU_QUANT_COMPUTE_DTYPE", raising=False)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert compute_dtype() == (torch.bfloat16 if native else torch.float32)
    monkeypatch.setenv("CPU_QUANT_COMPUTE_DTYPE", "fp32")
    assert compute_dtype() == torch.float32
    monkeypatch.setenv("CPU_QUANT_COMPUTE_DTYPE", "fp16")
    with pytest.raises(CpuQuantError, match="bf16 or fp32"):
        compute_dtype()
