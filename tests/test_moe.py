"""Mixture-of-experts (Qwen3-MoE): experts one linear each, per-expert Hessians on the routed
tokens held to a slow reference that routes every token explicitly, the starved-expert fallback,
the formats that refuse MoE in one line, GGUF's stacked experts held to gguf-py, and (``-m e2e``)
real llama.cpp on a calibrated run's GGUF.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cpu_quant.core.errors import CpuQuantError
from cpu_quant.core.experts import ExpertList, moe_family, unfuse_experts
from cpu_quant.formats import get_format
from cpu_quant.formats.gguf import architectures as gguf_architectures
from cpu_quant.formats.gguf import reader as gguf_reader
from cpu_quant.models.tiny import TinyShape, make_tiny_model, tiny_config
from cpu_quant.quantize.experts import FALLBACK
from cpu_quant.quantize.gptq import GridSpec, quantize_rtn
from cpu_quant.quantize.hessians import HessianAccumulator
from cpu_quant.quantize.pipeline import quantize_checkpoint
from cpu_quant.quantize.settings import QuantSettings
from cpu_quant.quantize.streaming import LayerStream
from tests.conftest import run_cli
from tests.formats.test_gguf import LOGITS_SCRIPT
from tests.helpers.gguf_rtn import write_gguf

# small enough for the unit tier: 8 experts, 2 per token; every in-features a multiple of 32
SMALL = TinyShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tied=True,
                  experts=8, experts_per_token=2, expert_intermediate=32)
CALIB = dict(samples=4, seqlen=128, batch_size=2)


@pytest.fixture(scope="module")
def small_moe(demo_src: Path, tmp_path_factory) -> Path:
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "small", demo_src,
                           shape=SMALL)


@pytest.fixture(scope="module")
def starved_moe(small_moe: Path, tmp_path_factory) -> Path:
    """The small model with expert 0's router row zeroed and the others' scaled up: expert 0's
    logit is 0 while the seven others spread wide, so it is among a token's two only when at
    most one other logit is positive (1 in 16 tokens), below the 64 tokens its Hessian needs."""
    dst = tmp_path_factory.mktemp("moe") / "starved"
    dst.mkdir()
    for f in small_moe.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(small_moe / "model.safetensors")
    for i in range(SMALL.layers):
        gate = tensors[f"model.layers.{i}.mlp.gate.weight"].float() * 20
        gate[0] = 0
        tensors[f"model.layers.{i}.mlp.gate.weight"] = gate.to(torch.bfloat16)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# -- the model -----------------------------------------------------------------------------------
def test_expert_list_computes_what_the_fused_experts_compute() -> None:
    """The unfused experts (one nn.Linear per projection) give transformers' fused module's
    output for the same weights and routing; within float32 rounding (the fused module
    multiplies gate and up as one matrix)."""
    import transformers

    config = tiny_config("qwen3_moe", SMALL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fused = model.model.layers[0].mlp.experts
    with torch.no_grad():
        fused.gate_up_proj.normal_(0, 0.1)
        fused.down_proj.normal_(0, 0.1)
    x = torch.randn(50, SMALL.hidden)
    _, weights, index = model.model.layers[0].mlp.gate(x)
    want = fused(x, index, weights)
    assert unfuse_experts(model) == SMALL.layers
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertList) and len(experts) == SMALL.experts
    f = SMALL.expert_intermediate
    with torch.no_grad():
        for e, mlp in enumerate(experts):
            mlp.gate_proj.weight.copy_(fused.gate_up_proj[e, :f])
            mlp.up_proj.weight.copy_(fused.gate_up_proj[e, f:])
            mlp.down_proj.weight.copy_(fused.down_proj[e])
    got = experts(x, index, weights)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, torch.zeros_like(got))


def _routed_inputs(stream: LayerStream, i: int, hidden: list[torch.Tensor]) -> dict[int, dict]:
    """The slow reference: the MoE block's input per token (hooked), then every token routed by
    hand (softmax over the router's logits, top-k, the expert's own gate/up for down's
    input): expert -> {"x": gate/up inputs, "h": down inputs} as float64 rows."""
    layer = stream.layers[i]
    mlp = layer.mlp
    seen: list[torch.Tensor] = []
    handle = mlp.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        list(stream.forward_layer(i, hidden))
    finally:
        handle.remove()
    k = stream.config.num_experts_per_tok
    out: dict[int, dict] = {e: {"x": [], "h": []} for e in range(len(mlp.experts))}
    with torch.no_grad():
        for x in seen:
            for t in range(x.shape[0]):
                row = x[t:t + 1]
                probs = torch.softmax(torch.nn.functional.linear(row, mlp.gate.weight).float(), -1)
                for e in torch.topk(probs, k, dim=-1).indices[0].tolist():
                    expert = mlp.experts[e]
                    h = expert.act_fn(expert.gate_proj(row)) * expert.up_proj(row)
                    out[e]["x"].append(row.double())
                    out[e]["h"].append(h.double())
    return out


def test_per_expert_hessians_equal_a_slow_reference(small_moe: Path) -> None:
    """Each expert's linears collect their Hessian from exactly the tokens the router sends
    them: the counts equal a by-hand routing of every token, and the Hessians its float64
    ``2 XᵀX / n`` within the fixed-point product's float32 rounding (1e-5 relative)."""
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.data.mix import load_calibration
    from cpu_quant.quantize.pipeline import calibration_batches

    settings = QuantSettings(**CALIB)
    batches = calibration_batches(small_moe, settings, load_calibration("austen"))
    ckpt = open_checkpoint(small_moe)
    stream = LayerStream(ckpt)
    hidden = stream.capture(batches)
    for i in range(SMALL.layers):
        stream.load_layer(i)
        linears = stream.linears(i)
        acc = HessianAccumulator(linears)
        try:
            stream.observe_layer(i, hidden, acc.begin_batch, acc.end_batch)
        finally:
            acc.close()
        ref = _routed_inputs(stream, i, hidden)
        checked = 0
        for e, rows in ref.items():
            prefix = f"model.layers.{i}.mlp.experts.{e}."
            for proj, key in (("gate_proj", "x"), ("up_proj", "x"), ("down_proj", "h")):
                name = prefix + proj
                assert acc.count.get(name, 0) == len(rows[key]), name
                if not rows[key]:
                    continue
                x = torch.cat(rows[key])
                want = 2 * x.t() @ x / x.shape[0]
                got = acc.hessian(name).double()
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max()), name
                checked += 1
        assert checked >= 3 * 4  # most experts saw tokens
        hidden = list(stream.forward_layer(i, hidden))
        stream.unload_layer(i)
    ckpt.close()


@pytest.mark.e2e
def test_starved_expert_falls_back_and_is_reported(starved_moe: Path, tmp_path: Path) -> None:
    """An expert with fewer routed tokens than its widest input is quantized by round-to-nearest
    with the scale search weighted by its Hessian's diagonal (bit for bit), recorded in the
    report with every expert's token count; the others take GPTQ; the router stays bf16."""
    from cpu_quant.core.io.checkpoint import open_checkpoint

    settings = QuantSettings(quantize_head=False, **CALIB)
    report = quantize_checkpoint(starved_moe, tmp_path / "out", settings, [get_format("gguf")],
                                 progress=False)
    experts = report.experts
    assert experts is not None and experts["experts"] == SMALL.layers * SMALL.experts
    by_name = {t.name: t for t in report.tensors}
    path = next((tmp_path / "out").glob("*.gguf"))
    src = open_checkpoint(starved_moe)
    r = gguf.GGUFReader(path)
    for i in range(SMALL.layers):
        block = experts["blocks"][f"model.layers.{i}.mlp.experts"]
        assert block["min_tokens"] == SMALL.hidden
        assert sum(block["tokens"]) == CALIB["samples"] * CALIB["seqlen"] * SMALL.experts_per_token
        starved = [e for e, n in enumerate(block["tokens"]) if n < SMALL.hidden]
        assert 0 in starved and len(starved) < SMALL.experts  # the rigged expert, not all
        assert block["fallback"] == starved
        for e in range(SMALL.experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                t = by_name[f"model.layers.{i}.mlp.experts.{e}.{proj}"]
                assert t.gptq_fallback == (FALLBACK if e in starved else None), t.name
        router = src.tensor(f"model.layers.{i}.mlp.gate.weight")
        stored = next(t for t in r.tensors if t.name == f"blk.{i}.ffn_gate_inp.weight")
        assert stored.tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(torch.from_numpy(np.array(stored.data)).reshape(router.shape),
                           router.float())
    src.close()
    assert experts["experts_fallback"] == sum(len(b["fallback"]) for b in experts["blocks"].values())
    assert "router" in experts["router"]


def test_fallback_codes_are_weighted_rtn() -> None:
    """The schedule quantizes a job marked with the fallback by round-to-nearest with the
    scale search weighted by its Hessian's diagonal, bit for bit, and records it; the same job
    without the mark takes GPTQ (other codes)."""
    from cpu_quant.quantize.plan import LinearPlan
    from cpu_quant.quantize.schedule import QuantJob, quantize_linears

    torch.manual_seed(1)
    w = torch.randn(32, 64)
    x = torch.randn(20, 64) * torch.linspace(0.1, 3, 64)  # 20 tokens < 64 in-features
    h = 2 * x.t() @ x / 20
    plan = LinearPlan("model.layers.0.mlp.experts.0.gate_proj", 64, 32, True, 32)
    settings, grid = QuantSettings(), GridSpec(symmetric=True, scale_search=True)
    [(fell, rep)] = quantize_linears([QuantJob(w, plan, h, FALLBACK)], settings, grid)
    [(gptq, rep2)] = quantize_linears([QuantJob(w, plan, h)], settings, grid)
    want = quantize_rtn(w, 32, grid, torch.diag(h))
    assert torch.equal(fell.codes, want.codes) and torch.equal(fell.scales, want.scales)
    assert rep.gptq_fallback == FALLBACK and rep2.gptq_fallback is None
    assert not torch.equal(gptq.codes, want.codes)


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["gptq", "cpu_int4"])
def test_formats_without_moe_runtime_refuse_in_one_line(small_moe: Path, tmp_path: Path,
                                                        fmt: str) -> None:
    proc = run_cli("gptq", str(small_moe), str(tmp_path / "out"), "--format", fmt, "--no-eval",
                   check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Qwen3-MoE experts" in errors[0] and "--format gguf" in errors[0]
    assert not (tmp_path / "out").exists()


def test_several_processes_refuse_moe_in_one_line(small_moe: Path, tmp_path: Path) -> None:
    """--nproc: the ranks' per-expert Hessian sums would not pair up; refused before work."""
    proc = run_cli("gptq", str(small_moe), str(tmp_path / "out"), "--format", "gguf",
                   "--nproc", "2", "--samples", "4", "--seqlen", "64", "--batch-size", "2",
                   "--no-eval", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: a mixture-of-experts model is quantized by one process: run "
                      "without --nproc or torchrun"]


def test_unsupported_moe_family_and_llama_cpp_mismatch_are_one_line(small_moe: Path) -> None:
    with pytest.raises(CpuQuantError, match="mixture-of-experts model_type 'mixtral'"):
        moe_family({"model_type": "mixtral", "num_local_experts": 8})
    assert moe_family({"model_type": "llama"}) is None
    cfg = json.loads((small_moe / "config.json").read_text())
    assert gguf_architectures.arch_spec(cfg).name == "qwen3moe"
    for bad, why in (({"norm_topk_prob": False}, "renormalises"),
                     ({"mlp_only_layers": [1]}, "dense ones"),
                     ({"decoder_sparse_step": 2}, "dense ones")):
        with pytest.raises(CpuQuantError, match=why) as exc:
            gguf_architectures.arch_spec({**cfg, **bad})
        assert "\n" not in str(exc.value)
        assert get_format("gguf").refuse_source({**cfg, **bad})


# -- GGUF ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_gguf(small_moe: Path, tmp_path_factory) -> tuple[Path, dict, dict]:
    """The small model through the GGUF sink (RTN, group 32): (file, GroupQuants, floats)."""
    return write_gguf(small_moe, tmp_path_factory.mktemp("moe-gguf"), group=32)


@pytest.mark.e2e
def test_gguf_stacks_every_expert_bit_for_bit(small_moe: Path, small_gguf) -> None:
    """Each stacked expert tensor holds every expert's Q4_0 blocks in expert order: gguf-py's
    dequantize of slice e equals our expert e's weights; the router is F32, exactly the bf16
    source; verify passes and inspect names the experts and the router kept float."""
    path, quant, floats = small_gguf
    r = gguf.GGUFReader(path)
    field = lambda k: r.get_field(k).contents()  # noqa: E731
    assert field("general.architecture") == "qwen3moe"
    assert field("qwen3moe.expert_count") == SMALL.experts
    assert field("qwen3moe.expert_used_count") == SMALL.experts_per_token
    assert field("qwen3moe.expert_feed_forward_length") == SMALL.expert_intermediate
    tensors = {t.name: t for t in r.tensors}
    seen = 0
    for i in range(SMALL.layers):
        for gname, proj in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"),
                            ("ffn_down_exps", "down_proj")):
            t = tensors[f"blk.{i}.{gname}.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
            theirs = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
            assert theirs.shape[0] == SMALL.experts
            for e in range(SMALL.experts):
                ours = quant[f"model.layers.{i}.mlp.experts.{e}.{proj}"].dequantize()
                assert torch.equal(torch.from_numpy(theirs[e].copy()).view(torch.int32),
                                   ours.view(torch.int32)), (t.name, e)
                seen += 1
        router = tensors[f"blk.{i}.ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
        want = floats[f"model.layers.{i}.mlp.gate.weight"].float()
        assert torch.equal(torch.from_numpy(np.array(router.data)).reshape(want.shape), want)
    assert seen == 3 * SMALL.layers * SMALL.experts
    back = gguf_reader.unpack(path)
    assert set(back) == set(quant)
    found = gguf_reader.verify(path)
    assert [f for f in found if f.severity == "error"] == []
    assert any(f.check == "gguf-experts" and "router" in f.message for f in found)
    cfg = json.loads((small_moe / "config.json").read_text())
    assert [f for f in gguf_reader.verify(path, cfg) if f.severity == "error"] == []
    summary = gguf_reader.inspect(path)
    assert "router" in summary["kept_float"] and summary["experts"].startswith("8 per layer")


def test_gguf_verify_refuses_a_wrong_expert_count(small_moe: Path, small_gguf) -> None:
    path = small_gguf[0]
    cfg = json.loads((small_moe / "config.json").read_text())
    errors = [f for f in gguf_reader.verify(path, {**cfg, "num_local_experts": 16})
              if f.severity == "error"]
    assert {f.tensor for f in errors} >= {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight"}


# -- e2e: real llama.cpp on a calibrated run -----------------------------------------------------
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
          411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 10576, 1601, 260, 2914, 282, 4649, 47]
# llama.cpp rounds the activations to Q8_0 before each Q4_0 product, so its logits differ from
# torch's by a little (on this model the largest teacher-forced difference was 0.015, the
# logits' std 0.32): a greedy step whose two best torch logits are closer than twice the
# largest difference measured on the same run may go either way. Larger differences than
# MAX_LOGIT_DIFF mean a layout error, not rounding.
MAX_LOGIT_DIFF = 0.1


def _dequantized_torch(src: Path, path: Path):
    """The source model holding every tensor the GGUF quantizes as llama.cpp reads it: the
    Q4_0 linears (experts included) and the Q8_0 token embedding, dequantized."""
    from cpu_quant.eval.dequantized import load_model

    model = load_model(src, dtype=torch.float32)
    modules = dict(model.named_modules())
    for name, gq in gguf_reader.unpack(path).items():
        modules[name].weight.data = gq.dequantize().float()
    emb = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    model.get_input_embeddings().weight.data = torch.from_numpy(
        gguf.quants.dequantize(np.array(emb.data), emb.tensor_type).copy()).float()
    return model


def _torch_steps(model, prompt: list[int], generated: list[int]) -> list[tuple[int, float]]:
    """For each step of ``generated`` (llama.cpp's greedy tokens), torch's choice at llama.cpp's
    own prefix and how far below it torch puts llama.cpp's token (0 when they agree)."""
    out = []
    with torch.no_grad():
        for s, token in enumerate(generated):
            logits = model(torch.tensor([prompt + generated[:s]])).logits[0, -1]
            best = int(logits.argmax())
            out.append((best, float(logits[best] - logits[token])))
    return out


@pytest.mark.e2e
def test_llama_cpp_runs_the_calibrated_moe_gguf(demo_src: Path, tmp_path: Path) -> None:
    """The tiny Qwen3-MoE (Qwen3-30B-A3B's ratios) quantized by the command line (per-expert
    GPTQ) to GGUF verifies, and real llama.cpp's greedy tokens equal the dequantized torch
    model's (each step torch's own choice at llama.cpp's prefix, or a near tie within twice the
    largest logit difference measured, :data:`MAX_LOGIT_DIFF`), with teacher-forced top-1 >= 0.9
    and KL below 0.05 nats, as the dense model's llama.cpp test asks."""
    from benchmarks.peers.llama_cpp_env import ready_env
    from tests.conftest import REPO

    env = ready_env()
    if env is None:
        pytest.skip("llama-cpp-python peer venv not built (python -m benchmarks.peers.llama_cpp_env)")
    src = make_tiny_model("qwen3_moe", tmp_path / "qwen3-moe", demo_src)
    dst = tmp_path / "out"
    run_cli("gptq", str(src), str(dst), "--format", "gguf", "--samples", "8", "--seqlen", "256",
            "--no-eval")
    report = json.loads(next(dst.glob("*.quantization_report.json")).read_text())
    experts = report["experts"]
    assert experts["experts"] == 2 * 32 and 0 < experts["experts_fallback"] < 64
    verify = run_cli("verify", str(dst))
    assert "0 error(s)" in verify.stdout + verify.stderr
    path = next(dst.glob("*.gguf"))

    out = tmp_path / "logits.npy"
    proc = subprocess.run([str(env.python), "-c", LOGITS_SCRIPT, str(path), str(out),
                           json.dumps(TOKENS), str(REPO)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    theirs = torch.from_numpy(np.load(out)).double()
    model = _dequantized_torch(src, path)
    with torch.no_grad():
        ours = model(torch.tensor([TOKENS])).logits[0].double()
    p, q = torch.log_softmax(ours, -1), torch.log_softmax(theirs, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    diff = (ours - theirs).abs().max().item()
    steps = _torch_steps(model, TOKENS[:8], result["generated"])
    print(f"llama.cpp vs torch (Qwen3-MoE): KL {kl:.2e}, top-1 {top1:.3f}, largest logit "
          f"difference {diff:.4f}; llama.cpp {result['generated']}, torch at its prefixes "
          f"{[b for b, _ in steps]}, gaps {[round(g, 4) for _, g in steps]}")
    assert top1 >= 0.9 and kl < 0.05 and diff < MAX_LOGIT_DIFF
    assert len(result["generated"]) == 8
    # every greedy step is torch's choice, or a near tie within the measured rounding
    for s, (best, gap) in enumerate(steps):
        assert best == result["generated"][s] or gap <= 2 * diff, (s, best, gap)
