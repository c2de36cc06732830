"""`cpu-quant eval` as llama-perplexity users expect it: standard errors, percentiles, a saved
reference that scores the next artifact without the bf16 model, and no --resume on Ctrl-C."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from cpu_quant.eval import stats
from cpu_quant.eval.fidelity import (
    EvalSettings,
    FreshReference,
    StoredReference,
    _eval_windows,
    _write_saved,
    score_against,
)
from cpu_quant.eval.reference_logits import load_reference


def test_stats_follow_llama_perplexity_formulas():
    g = torch.Generator().manual_seed(0)
    kl = torch.rand(1000, generator=g, dtype=torch.float64) ** 3
    nll_r = torch.rand(1000, generator=g, dtype=torch.float64) * 4
    nll_q = nll_r + 0.1 * torch.rand(1000, generator=g, dtype=torch.float64)
    n = kl.numel()
    s = stats.kl_summary(kl)
    assert s["mean"] == pytest.approx(float(kl.mean()))
    assert s["stderr"] == pytest.approx(float(kl.std()) / math.sqrt(n))
    assert s["median"] == pytest.approx(float(kl.median()), abs=1e-3)
    assert s["max"] == float(kl.max()) and s["p90"] < s["p99"] < s["max"]
    ppl = stats.perplexity(nll_q)  # delta method: exp(mean) * se(mean)
    assert ppl.value == pytest.approx(math.exp(float(nll_q.mean())))
    assert ppl.stderr == pytest.approx(ppl.value * float(nll_q.std()) / math.sqrt(n))
    # the difference of two correlated perplexities: far smaller error than either alone
    d = stats.perplexity_delta(nll_q, nll_r)
    assert d.value == pytest.approx(ppl.value - stats.perplexity(nll_r).value)
    assert 0 < d.stderr < 0.2 * ppl.stderr
    top1 = stats.proportion(torch.arange(n) % 4 != 0)
    assert top1.value == 0.75 and top1.stderr == pytest.approx(math.sqrt(0.75 * 0.25 / (n - 1)))
    h = stats.kl_histogram(kl)
    assert sum(h["counts"]) == n and len(h["counts"]) == len(h["edges"])


def _rtn_copy(model):
    """A round-to-nearest 4-bit (group 64, symmetric) copy of every linear, in place."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                n, k = m.weight.shape
                x = m.weight.reshape(n, k // 64, 64)
                s = x.abs().amax(-1, keepdim=True) / 7.5
                m.weight.copy_((torch.clamp(torch.round(x / s), -8, 7) * s).reshape(n, k))
    return model


@pytest.mark.e2e
def test_saved_reference_gives_the_fresh_kl_on_the_demo_model(demo_src, tmp_path):
    """Acceptance: KL from a --save-reference file equals a fresh reference run's to 1e-4
    (it is the same full-vocabulary KL, so the difference is float rounding)."""
    from transformers import AutoTokenizer

    from cpu_quant.eval.dequantized import load_model

    tok = AutoTokenizer.from_pretrained(demo_src)
    reference = load_model(demo_src)
    quantized = _rtn_copy(load_model(demo_src))
    settings = EvalSettings(windows=2, seqlen=128, prompts=2, prompt_len=8, new_tokens=4)
    scored, prompts = _eval_windows(tok, settings)
    fresh = FreshReference(reference, keep=True)
    first = score_against(fresh, quantized, tok, scored, prompts, settings)["weights"]
    path = tmp_path / "ref.safetensors"
    _write_saved(path, fresh, scored, prompts, ["t"], settings, demo_src)
    second = score_against(StoredReference(load_reference(path)), quantized, tok, scored, prompts,
                           settings)["weights"]
    assert first.kl_mean > 0.05  # a real difference to measure
    assert abs(first.kl_mean - second.kl_mean) < 1e-4
    assert abs(first.kl_p99 - second.kl_p99) < 1e-4
    assert second.ppl_reference == pytest.approx(first.ppl_reference, rel=1e-6)
    assert second.top1_agreement == first.top1_agreement
    assert second.greedy_prefix_fraction == first.greedy_prefix_fraction


@pytest.fixture(scope="module")
def tiny_rtn(tiny_llama, tmp_path_factory):
    from cpu_quant.quantize.pipeline import quantize_checkpoint
    from cpu_quant.quantize.settings import QuantSettings

    dst = tmp_path_factory.mktemp("tiny-rtn") / "rtn"
    quantize_checkpoint(tiny_llama, dst, QuantSettings(method="rtn", calib="none", group_size=32),
                        progress=False)
    return dst


SMALL = ["--windows", "2", "--seqlen", "64", "--prompts", "2", "--new-tokens", "4"]


def _eval(*args: str):
    from cpu_quant.cli import main

    return CliRunner().invoke(main, ["eval", *args], catch_exceptions=False)


@pytest.mark.e2e
def test_eval_json_saved_reference_and_refusal(tiny_llama, tiny_rtn, tmp_path):
    ref_file = tmp_path / "ref.safetensors"
    fresh = _eval(str(tiny_rtn), "--reference", str(tiny_llama), *SMALL, "--json",
                  "--save-reference", str(ref_file), "--output-json", str(tmp_path / "a.json"))
    assert fresh.exit_code == 0, fresh.stderr
    doc = json.loads(fresh.stdout)  # stdout holds the JSON document and nothing else
    assert doc == json.loads((tmp_path / "a.json").read_text())
    w = doc["fidelity"]["weights"]
    for key in ("kl_mean", "kl_stderr", "kl_median", "kl_p90", "kl_p99", "kl_max",
                "ppl_quantized_stderr", "ppl_delta_stderr", "top1_stderr", "kl_histogram"):
        assert key in w
    assert "fidelity vs the bf16 source" in fresh.stderr  # the human table went to stderr
    # the reference's grid: a random model's weights sit on none, and nothing is said about it
    assert doc["reference_grid"]["counts"] == {"no grid of 5 bits or fewer": 14}, doc["reference_grid"]
    assert "already sit on a quantization grid" not in fresh.stderr
    saved = _eval(str(tiny_rtn), "--reference-logits", str(ref_file), *SMALL, "--json")
    assert saved.exit_code == 0, saved.stderr
    w2 = json.loads(saved.stdout)["fidelity"]["weights"]
    assert abs(w2["kl_mean"] - w["kl_mean"]) < 1e-4
    assert w2["top1_agreement"] == w["top1_agreement"]
    other = _eval(str(tiny_rtn), "--reference-logits", str(ref_file), "--windows", "3",
                  "--seqlen", "64", "--prompts", "2", "--new-tokens", "4")
    assert other.exit_code == 2 and "was saved with windows=2" in other.stderr
    only = _eval("--reference", str(tiny_llama), *SMALL, "--save-reference",
                 str(tmp_path / "only.safetensors"), "-q")
    assert only.exit_code == 0 and (tmp_path / "only.safetensors").is_file()


def test_eval_interrupt_does_not_suggest_resume(monkeypatch, tiny_llama, tiny_rtn):
    import cpu_quant.cli.eval as commands

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "run_eval", interrupted)
    result = _eval(str(tiny_rtn), "--reference", str(tiny_llama))
    assert result.exit_code == 130
    assert "interrupted" in result.stderr and "--resume" not in result.stderr


def test_eval_threads_reach_torch(tiny_llama, tiny_rtn):
    before = torch.get_num_threads()
    try:
        result = _eval(str(tiny_rtn), "--reference", str(tiny_llama), *SMALL, "--json",
                       "--threads", "1", "-q")
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["provenance"]["threads"] == 1
        assert "eval windows" not in result.stderr  # -q: no progress bars
    finally:
        torch.set_num_threads(before)


def test_interrupted_quick_eval_says_the_artifact_is_complete(monkeypatch, tiny_llama, tmp_path):
    import cpu_quant.eval.fidelity as fidelity
    from cpu_quant.cli import main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(fidelity, "evaluate_artifact", interrupted)
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["gptq", str(tiny_llama), str(dst), "--method", "rtn",
                                       "--calib", "none", "--group", "32", "-q"],
                                catch_exceptions=False)
    assert result.exit_code == 130
    assert "is complete" in result.stderr and "--resume" not in result.stderr
    assert (dst / "README.md").is_file() and (dst / "config.json").is_file()


def test_saved_reference_refuses_other_text_or_tokens(tmp_path):
    from cpu_quant.core.errors import CpuQuantError
    from cpu_quant.eval.reference_logits import SavedReference

    settings = {"windows": 1, "seqlen": 4, "prompts": 1, "prompt_len": 2, "new_tokens": 1, "text": None}
    windows, prompts = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6]])
    saved = SavedReference(windows, prompts, torch.tensor([[7]]), [], "abc", settings, "src")
    saved.check_matches(windows, prompts, "abc", settings, tmp_path)  # the same: accepted
    with pytest.raises(CpuQuantError, match="different held-out text"):
        saved.check_matches(windows, prompts, "abd", settings, tmp_path)
    with pytest.raises(CpuQuantError, match="different token ids"):
        saved.check_matches(windows + 1, prompts, "abc", settings, tmp_path)
    with pytest.raises(CpuQuantError, match="saved with seqlen=4"):
        saved.check_matches(windows, prompts, "abc", {**settings, "seqlen": 8}, tmp_path)


def test_eval_refuses_a_module_that_a_dynamic_rule_makes_8_bit(tiny_llama, tiny_rtn, tmp_path):
    """GPTQModel 7.6.0 with lm_head=True stores the head at 8 bits through a `dynamic` rule:
    one error line naming the module, not a traceback from unpacking it as 4-bit."""
    import shutil

    art = tmp_path / "head8"
    shutil.copytree(tiny_rtn, art)
    cfg = json.loads((art / "config.json").read_text())
    cfg["quantization_config"]["dynamic"] = {"lm_head": {"bits": 8, "group_size": 32}}
    (art / "config.json").write_text(json.dumps(cfg))
    result = _eval(str(art), "--reference", str(tiny_llama), *SMALL)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code != 0 and lines[-1].startswith("error: lm_head: 8-bit weights"), \
        result.stderr


def test_eval_memory_plan_follows_the_available_memory(tiny_llama, tiny_rtn):
    """Both models side by side where they fit; else the reference first; else bf16, said;
    else one line. The thresholds are the models' own sizes (the 1B-8B models' evaluations
    take the later branches on a 24 GiB machine)."""
    import torch

    from cpu_quant.core.errors import CpuQuantError
    from cpu_quant.eval.fidelity import MODEL_HEADROOM, model_bytes, plan_memory

    ref, quant = model_bytes(tiny_llama, torch.float32), model_bytes(tiny_rtn, torch.float32)
    assert ref == quant > 0  # the quantized model dequantizes to the reference's shapes
    both = int((ref + quant) * MODEL_HEADROOM)
    plan = plan_memory(tiny_llama, tiny_rtn, torch.float32, available=both)
    assert plan == type(plan)(torch.float32, False, None)
    plan = plan_memory(tiny_llama, tiny_rtn, torch.float32, available=both - 1)
    assert plan.dtype == torch.float32 and plan.reference_first and plan.note is None
    plan = plan_memory(tiny_llama, tiny_rtn, torch.float32, available=int(ref * MODEL_HEADROOM) - 1)
    assert plan.dtype == torch.bfloat16 and plan.reference_first and "bf16" in plan.note
    with pytest.raises(CpuQuantError, match="GiB"):
        plan_memory(tiny_llama, tiny_rtn, torch.float32, available=int(ref / 2 * MODEL_HEADROOM) - 1)


def test_reference_first_gives_the_side_by_side_scores(tiny_llama, tiny_rtn, monkeypatch):
    """The reference run first and freed (what a model too large for both in memory gets)
    scores as the two models side by side do: the same full-vocabulary KL, to rounding."""
    import cpu_quant.eval.fidelity as fidelity
    from cpu_quant.eval.fidelity import evaluate_artifact

    settings = EvalSettings(windows=2, seqlen=64, prompts=2, prompt_len=8, new_tokens=4)
    side = evaluate_artifact(tiny_rtn, tiny_llama, settings)["weights"]
    one_at_a_time = fidelity.EvalPlan(fidelity.torch.float32, True, None)
    monkeypatch.setattr(fidelity, "plan_memory", lambda *a, **k: one_at_a_time)
    first = evaluate_artifact(tiny_rtn, tiny_llama, settings)["weights"]
    assert side.kl_mean > 0
    assert abs(side.kl_mean - first.kl_mean) < 1e-4 and first.top1_agreement == side.top1_agreement
    assert first.greedy_prefix_fraction == side.greedy_prefix_fraction
