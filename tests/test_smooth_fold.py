"""Activation smoothing folded into the checkpoint (``gptq --smooth``), on tiny random models.

The slow reference is the model itself in float64: folded with any positive factors, it must
compute the unfolded model's logits to 1e-5 relative."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cpu_quant.core import smoothing_factors
from cpu_quant.core.errors import CpuQuantError
from cpu_quant.core.io.checkpoint import open_checkpoint
from cpu_quant.core.smoothing_factors import (
    FACTORS_FILE,
    SmoothedCheckpoint,
    all_folds,
    fold_tensor,
    load_factors,
)
from cpu_quant.models.tiny import make_tiny_model
from cpu_quant.quantize import smooth_fold
from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint
from cpu_quant.quantize.smooth_fold import refuse, w4a8_error

FOLDED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module", params=FOLDED_ARCHS)
def tiny(request, demo_src, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_model(arch, tmp_path_factory.mktemp(arch) / "src", demo_src)


def _float64_model(path: Path, state: dict[str, torch.Tensor] | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    if state is not None:
        cfg.tie_word_embeddings = False
        if hasattr(cfg, "text_config"):
            cfg.text_config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    ckpt = open_checkpoint(path)
    tensors = {n: ckpt.tensor(n).to(torch.float64) for n in ckpt.names}
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    if state is not None:
        tensors.update(state)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not [m for m in missing if "rotary" not in m] and not unexpected
    return model


def _folds(path: Path) -> list:
    ckpt = open_checkpoint(path)
    cfg = json.loads((path / "config.json").read_text())
    names = set(ckpt.names)
    return all_folds(cfg, "model.layers", int(cfg["num_hidden_layers"]), names,
                     smoothing_factors.HEAD, "model.norm.weight")


@torch.no_grad()
def test_folded_model_computes_the_same_logits_in_float64(tiny):
    """Every fold at once (norms, v rows with grouped-query heads, up rows, the head), random
    factors over three orders of magnitude: the same logits to 1e-5 relative."""
    arch, path = tiny
    folds = _folds(path)
    assert len(folds) == 4 * 2 + 1
    gen = torch.Generator().manual_seed(1)
    ckpt = open_checkpoint(path)
    factors = {}
    for f in folds:
        t = ckpt.tensor(f.divide)
        factors[f.key] = torch.exp(torch.empty(t.shape[0], dtype=torch.float64).uniform_(
            -3.5, 3.5, generator=gen))
    base = _float64_model(path)
    state = {n: fold_tensor(n, p.detach(), folds, factors)
             for n, p in base.state_dict().items() if n in smoothing_factors.touched(folds)}
    assert "lm_head.weight" in state and "model.embed_tokens.weight" not in state
    folded = _float64_model(path, state)
    ids = torch.randint(0, 49152, (2, 24), generator=gen)
    want = base(input_ids=ids).logits
    got = folded(input_ids=ids).logits
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-5, (arch, rel)
    # and the folds did something: the weights moved by far more than that
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((state[q] - base.state_dict()[q]).norm() / base.state_dict()[q].norm()) > 0.5


def test_gqa_factor_is_shared_by_the_heads_that_read_one_v_row(tiny):
    arch, path = tiny
    fold = next(f for f in _folds(path) if f.divide.endswith("v_proj.weight"))
    s = torch.arange(1.0, 1 + open_checkpoint(path).shape(fold.divide)[0])
    cols = fold.expand(s)
    assert cols.numel() == s.numel() * fold.rep
    d = fold.head_dim
    for h in range(cols.numel() // d):
        kv = h // fold.rep
        assert torch.equal(cols[h * d:(h + 1) * d], s[kv * d:(kv + 1) * d])


def test_the_search_never_does_worse_than_no_smoothing():
    """An input with outlier channels: the chosen factors cut the emulated W4A8 error; an
    input without any: no smoothing may win, and then s = 1 exactly."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    x = torch.randn(512, 64, generator=gen)
    x[:, 3] *= 60
    x[:, 40] *= 25
    fold = smoothing_factors.Fold("n.weight", ("a.weight",))
    s, choice = smooth_fold.choose(fold, x.abs().amax(0), x, [w], [32])
    assert choice.alpha is not None and choice.error < 0.5 * choice.error_unsmoothed
    assert abs(w4a8_error(x, [w], s, [32]) - choice.error) < 1e-9
    flat = torch.randn(512, 64, generator=gen)
    s2, c2 = smooth_fold.choose(fold, flat.abs().amax(0), flat, [w], [32])
    assert c2.error <= c2.error_unsmoothed
    if c2.alpha is None:
        assert torch.equal(s2, torch.ones(64))


# the demo model's four folds of a layer (scaled weights' sizes), and its head
LAYER_COSTS = [960 * 576, 576 * 576, 3072 * 576, 576 * 1536]
HEAD_COST = 49152 * 576


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_candidate_shares_cover_every_candidate_once(world):
    """What a distributed run's ranks evaluate: every candidate of every fold exactly once, a
    fold whole on one rank unless it outweighs a rank's share (the head), which is spread."""
    for costs in (LAYER_COSTS, [HEAD_COST], [7, 7, 7]):
        shares = smooth_fold.assign_candidates(costs, world)
        assert len(shares) == world
        for f in range(len(costs)):
            got = [c for share in shares for c in share.get(f, ())]
            assert sorted(got, key=smooth_fold.CANDIDATES.index) == list(smooth_fold.CANDIDATES)
    loads = [sum(LAYER_COSTS[f] for f in share) for share in smooth_fold.assign_candidates(
        LAYER_COSTS, 2)]
    assert loads[0] == loads[1]  # gate/up against q/k/v, o and down
    head = smooth_fold.assign_candidates([HEAD_COST], world)
    assert sorted(len(share.get(0, ())) for share in head)[::-1] == [
        len(range(r, len(smooth_fold.CANDIDATES), world)) for r in range(world)]


def test_candidates_evaluated_apart_pick_what_all_at_once_picks():
    """A fold's candidates split over ranks: the same factor and errors, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen)
    x = torch.randn(512, 64, generator=gen)
    x[:, 5] *= 40
    fold = smoothing_factors.Fold("n.weight", ("a.weight",))
    s, choice = smooth_fold.choose(fold, x.abs().amax(0), x, [w], [32])
    errors: dict = {}
    for share in smooth_fold.assign_candidates([HEAD_COST], 3):
        errors.update(smooth_fold.candidate_errors(fold, x.abs().amax(0), x, [w], [32],
                                                   share[0]))
    s2, choice2 = smooth_fold.pick(errors)
    assert torch.equal(s, s2) and choice == choice2


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_unfoldable_architectures_are_refused_before_any_work(arch, demo_src, tmp_path):
    src = make_tiny_model(arch, tmp_path / "src", demo_src)
    cfg = json.loads((src / "config.json").read_text())
    assert refuse(cfg) and "--smooth cannot fold" in refuse(cfg)
    settings = QuantSettings(smooth=True, samples=2, seqlen=16, batch_size=2)
    with pytest.raises(CpuQuantError, match="--smooth cannot fold"):
        quantize_checkpoint(src, tmp_path / "out", settings, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_smoothed_run_writes_the_factors_and_its_float_tensors_are_the_folded_source(
        tiny_llama, tmp_path):
    """A smoothed GPTQ run of a tiny Llama: its factors file, its report, its norms equal to
    the source's folded with those factors (bf16), and its embedding untouched."""
    dst = tmp_path / "out"
    settings = QuantSettings(smooth=True, samples=8, seqlen=32, batch_size=2, group_size=32)
    report = quantize_checkpoint(tiny_llama, dst, settings, progress=False)
    factors = load_factors(dst)
    assert factors is not None and (dst / FACTORS_FILE).is_file()
    assert report.smoothing["stats_tokens"] == smooth_fold.STATS_BATCHES * 2 * 32
    assert set(report.smoothing["folds"]) == set(factors)
    src, art = open_checkpoint(tiny_llama), open_checkpoint(dst)
    folds = _folds(tiny_llama)
    view = SmoothedCheckpoint(src, folds, factors)
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                 "model.norm.weight", "model.embed_tokens.weight"):
        assert torch.equal(art.tensor(name), view.tensor(name).to(torch.bfloat16)), name
    assert torch.equal(art.tensor("model.embed_tokens.weight"), src.tensor("model.embed_tokens.weight"))
    # the factors file is not read as weights: no loader's *.safetensors glob matches it
    assert not FACTORS_FILE.endswith(".safetensors")


@pytest.mark.parametrize(("arch", "settings", "folds"), [
    ("llama", QuantSettings(), True),
    ("qwen3", QuantSettings(), True),
    ("qwen2", QuantSettings(), False),
    ("llama", QuantSettings(method="rtn"), False),
    ("llama", QuantSettings(symmetric=False), False),
    ("gemma2", QuantSettings(), False),
    ("phi3", QuantSettings(), False),
])
def test_the_default_folds_only_calibrated_symmetric_gptq_of_a_foldable_model(
        arch, settings, folds, demo_src, tmp_path):
    cfg = json.loads((make_tiny_model(arch, tmp_path / "src", demo_src) / "config.json").read_text())
    smooth, note = smooth_fold.default_smoothing(cfg, settings)
    assert smooth is folds
    # a model it cannot fold says why in the plan's notes; a setting that excludes it does not
    assert (note is not None) == (arch in ("gemma2", "phi3", "qwen2"))
    if note:
        assert note.startswith("activation smoothing not folded: ")
        assert ("--smooth folds it" in note) == (arch == "qwen2")


@pytest.mark.e2e
def test_the_gptq_default_smooths_and_reports_it_and_a_gemma_run_says_why_not(
        tiny_llama, demo_src, tmp_path):
    small = dict(samples=4, seqlen=32, batch_size=2, group_size=32, smooth=None)
    report = quantize_checkpoint(tiny_llama, tmp_path / "llama", QuantSettings(**small),
                                 progress=False)
    assert report.settings["smooth"] is True and report.smoothing is not None
    gemma = make_tiny_model("gemma2", tmp_path / "gemma", demo_src)
    report = quantize_checkpoint(gemma, tmp_path / "gemma-out", QuantSettings(**small),
                                 progress=False)
    assert report.settings["smooth"] is False and report.smoothing is None
    assert any(n.startswith("activation smoothing not folded") for n in report.plan_notes)


def test_smooth_without_calibration_is_refused():
    with pytest.raises(CpuQuantError, match="--smooth needs calibration"):
        QuantSettings(method="rtn", calib="none", smooth=True).validate()


@pytest.mark.parametrize("content", [b"not safetensors", "zero", "nan"])
def test_a_broken_factors_file_is_one_line(content, tmp_path):
    """verify --source and export-phone read the factors file: a truncated or foreign one, or
    factors that are not finite and positive, are refused in one line naming the file."""
    from cpu_quant.core.smoothing_factors import save_factors

    path = tmp_path / FACTORS_FILE
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        v = torch.ones(8)
        v[3] = 0.0 if content == "zero" else float("nan")
        save_factors(path, {"model.norm.weight": v})
    with pytest.raises(CpuQuantError, match="smoothing.factors"):
        load_factors(tmp_path)


def test_row_blocks_bound_the_candidates_memory_and_keep_their_errors(monkeypatch):
    """A weight larger than one block of rows (the head of an 8B model is 525M weights) is
    evaluated a block at a time: the same factors, the same errors to float rounding, as in one
    piece, and the column maxima exactly."""
    from cpu_quant.quantize import smoothing

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(256, 64, generator=gen)
    x[:, 5] *= 40
    fold = smoothing_factors.Fold("n.weight", ("a.weight",))
    whole = smooth_fold.candidate_errors(fold, x.abs().amax(0), x, [w], [32])
    monkeypatch.setattr(smoothing_factors, "BLOCK_ELEMENTS", 64 * 7)  # 7 rows a block: 43 blocks
    assert len(smoothing_factors.row_blocks(w)) == 43
    assert torch.equal(smoothing.column_absmax(w), w.abs().amax(0))
    blocked = smooth_fold.candidate_errors(fold, x.abs().amax(0), x, [w], [32])
    assert whole.keys() == blocked.keys()
    for alpha, (s, err) in whole.items():
        assert torch.equal(blocked[alpha][0], s)
        assert blocked[alpha][1] == pytest.approx(err, rel=1e-5)
