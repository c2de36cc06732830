"""True-sequential quantization (``quantize/sequential.py``) on every architecture we claim.

The staged path keeps each block's last-linear input and output instead of re-running the
block; these tests hold it to the definition it shortcuts: for each group of linears in call
order, the Hessian of its input from full forward passes with every earlier group already
quantized, and the layer's output from a full forward with every linear quantized.
"""

from __future__ import annotations

import pytest
import torch

from cpu_quant.core.io.checkpoint import open_checkpoint
from cpu_quant.models.tiny import TINY_ARCHS, make_tiny_model
from cpu_quant.quantize.gptq import GridSpec, quantize_rtn
from cpu_quant.quantize.hessians import gram
from cpu_quant.quantize.sequential import BatchStore, probe, run_true_sequential
from cpu_quant.quantize.streaming import LayerStream

EXPECTED_GROUPS = {
    "phi3": (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",),
             ("mlp.down_proj",)),
}
LLAMA_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 49152, (2, 32), generator=gen) for _ in range(3)]


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def stream_and_hidden(request, demo_src, tmp_path_factory):
    arch = request.param
    path = make_tiny_model(arch, tmp_path_factory.mktemp(arch) / "src", demo_src)
    stream = LayerStream(open_checkpoint(path))
    hidden = stream.capture(_batches())
    return arch, stream, hidden


def test_the_capture_leaves_no_input_embedding_held(stream_and_hidden):
    """Nothing runs the input embedding after the capture: its weight is not held through the
    layers (at 8B, 2 GB in float32), neither by the embedding nor by a tied head. A second
    capture loads it again and records the same inputs."""
    arch, stream, hidden = stream_and_hidden
    emb, out = stream.model.get_input_embeddings(), stream.model.get_output_embeddings()
    assert emb.weight.is_meta, arch
    assert out is None or out.weight.is_meta, arch
    again = stream.capture(_batches())
    assert all(torch.equal(a, b) for a, b in zip(again, hidden, strict=True))
    assert stream.model.get_input_embeddings().weight.is_meta


def _rtn(module: torch.nn.Linear, hessian: torch.Tensor) -> None:
    """A real quantization whose result depends on the Hessian (its diagonal weights the scale
    search), so a wrong Hessian shows in the weights and in the outputs."""
    gq = quantize_rtn(module.weight.data, 16, GridSpec(), torch.diag(hessian))
    module.weight.data = gq.dequantize().to(module.weight.dtype)


@torch.no_grad()
def test_staged_layer_equals_true_sequential_by_definition(stream_and_hidden, tmp_path):
    arch, stream, hidden = stream_and_hidden
    layer = stream.load_layer(0)
    try:
        structure = probe(layer, lambda: stream.call_layer(0, 0, hidden[0]))
        assert structure is not None, f"{arch}: the probe found no blocks"
        assert structure.groups == EXPECTED_GROUPS.get(arch, LLAMA_GROUPS)
        assert [b.child for b in structure.blocks] == ["self_attn", "mlp"]
        modules = dict(layer.named_modules())
        original = {n: modules[n].weight.data.clone() for g in structure.groups for n in g}

        # the definition: full forward passes, nothing kept, nothing skipped
        want_h = []
        for names in structure.groups:
            xs = []
            handle = modules[names[0]].register_forward_pre_hook(lambda m, a, xs=xs: xs.append(a[0]))
            for b, h in enumerate(hidden):
                stream.call_layer(0, b, h)
            handle.remove()
            hess = 2.0 * sum(gram(x.reshape(-1, x.shape[-1])) for x in xs) / sum(
                x.numel() // x.shape[-1] for x in xs)
            want_h.append(hess)
            for n in names:
                _rtn(modules[n], hess)
        want_w = {n: modules[n].weight.data.clone() for n in original}
        want_out = [stream.call_layer(0, b, h).to(torch.bfloat16) for b, h in enumerate(hidden)]

        for n, w in original.items():  # start again from the original weights
            modules[n].weight.data = w.clone()
        got_h = []

        def quantize_group(names, hessian):
            got_h.append(hessian)
            for n in names:
                _rtn(modules[n], hessian)

        for offload in (False, True):  # kept in memory, or on disk with --offload-activations
            got_h.clear()
            for n, w in original.items():
                modules[n].weight.data = w.clone()
            root = tmp_path / f"cache-{offload}"
            outputs = run_true_sequential(
                layer, structure, hidden, lambda b, h: stream.call_layer(0, b, h), quantize_group,
                lambda name, rows, root=root, offload=offload: BatchStore(
                    root / name if offload else None, rows),
                gram)
            got_out = list(outputs)
            assert len(got_h) == len(want_h)
            for names, got, want in zip(structure.groups, got_h, want_h, strict=True):
                assert torch.equal(got, want), f"{arch}: Hessian of {names[0]}"
            for n, w in want_w.items():
                assert torch.equal(modules[n].weight.data, w), f"{arch}: weights of {n}"
            for b, (got, want) in enumerate(zip(got_out, want_out, strict=True)):
                assert torch.equal(got, want), f"{arch}: output of batch {b}"
            if offload:  # the final pass deletes what it used
                assert not any(root.rglob("*.safetensors"))
        # the blocks run again as themselves afterwards
        assert "forward" not in vars(layer.self_attn) and "forward" not in vars(layer.mlp)
    finally:
        stream.unload_layer(0)


@torch.no_grad()
def test_probe_declines_a_block_whose_output_is_not_its_last_linear(stream_and_hidden):
    """A layer the shortcut would compute wrongly goes to the two-pass path instead."""
    arch, stream, hidden = stream_and_hidden
    layer = stream.load_layer(0)
    try:
        handle = layer.mlp.register_forward_hook(lambda m, a, out: out * 1.0)
        try:
            assert probe(layer, lambda: stream.call_layer(0, 0, hidden[0])) is None, arch
        finally:
            handle.remove()
        linears = [m for m in layer.mlp.modules() if isinstance(m, torch.nn.Linear)]

        def call_again(module, args):  # a linear run twice per call of the layer
            linears[0](args[0])

        hook = layer.mlp.register_forward_pre_hook(call_again)
        try:
            assert probe(layer, lambda: stream.call_layer(0, 0, hidden[0])) is None, arch
        finally:
            hook.remove()
        assert probe(layer, lambda: stream.call_layer(0, 0, hidden[0])) is not None, arch
    finally:
        stream.unload_layer(0)


FEEDS = {"gemma2": ("input_layernorm", "pre_feedforward_layernorm"),
         "gemma3": ("input_layernorm", "pre_feedforward_layernorm")}


@torch.no_grad()
def test_feeds_are_skipped_only_where_nothing_else_reads_them(stream_and_hidden):
    """The norm in front of a stored block is skipped (its output would be thrown away), unless
    its output reaches the layer some other way: here, a hook adds it to the MLP's input, which
    no identity check sees. The probe's replay must then keep the norm, not drop the layer."""
    arch, stream, hidden = stream_and_hidden
    layer = stream.load_layer(0)
    try:
        structure = probe(layer, lambda: stream.call_layer(0, 0, hidden[0]))
        assert tuple(b.feed for b in structure.blocks) == FEEDS.get(
            arch, ("input_layernorm", "post_attention_layernorm")), arch
        norm = getattr(layer, structure.blocks[0].feed)
        seen: list[torch.Tensor] = []
        handles = [norm.register_forward_hook(lambda m, a, out: seen.append(out)),
                   layer.mlp.register_forward_pre_hook(lambda m, a: (a[0] + seen[-1],))]
        try:
            guarded = probe(layer, lambda: stream.call_layer(0, 0, hidden[0]))
        finally:
            for h in handles:
                h.remove()
        assert guarded is not None, arch
        assert [b.feed for b in guarded.blocks] == [None, None], arch
        assert guarded.groups == structure.groups
    finally:
        stream.unload_layer(0)
