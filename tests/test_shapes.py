"""The random models of public shapes (``cpu_quant.models.shapes``), at the unit level: every
shape's config builds in transformers with the parameter count the module states, and the
weights are a function of the seed and the tensor's name alone."""

from __future__ import annotations

import json

import pytest
import torch

from cpu_quant.models.shapes import SHAPES, _shapes_of, random_tensor


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_config_builds_with_the_stated_parameter_count(name: str):
    shape = SHAPES[name]
    shapes = _shapes_of(shape.config())
    counted = sum(torch.Size(s).numel() for s in shapes.values()
                  if not s or len(s) > 1)  # linears and embeddings
    assert counted == shape.parameters()
    assert ("lm_head.weight" in shapes) is (not shape.tied)


def test_public_sizes_are_the_published_ones():
    billions = {n: s.parameters() / 1e9 for n, s in SHAPES.items()}
    assert billions["Llama-3.2-1B"] == pytest.approx(1.24, abs=0.01)
    assert billions["Llama-3.2-3B"] == pytest.approx(3.21, abs=0.01)
    assert billions["Qwen2.5-3B"] == pytest.approx(3.09, abs=0.01)
    assert billions["Qwen3-4B"] == pytest.approx(4.02, abs=0.01)
    assert billions["Llama-3-8B"] == pytest.approx(8.03, abs=0.01)


def test_weights_depend_on_seed_and_name_only():
    a = random_tensor("model.layers.0.mlp.up_proj.weight", (300, 64), 0.02, seed=0)
    b = random_tensor("model.layers.0.mlp.up_proj.weight", (300, 64), 0.02, seed=0)
    c = random_tensor("model.layers.1.mlp.up_proj.weight", (300, 64), 0.02, seed=0)
    d = random_tensor("model.layers.0.mlp.up_proj.weight", (300, 64), 0.02, seed=1)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    assert float(a.float().std()) == pytest.approx(0.02, rel=0.05)
    assert torch.equal(random_tensor("model.norm.weight", (8,), 0.02, 0), torch.ones(8, dtype=torch.bfloat16))
    assert torch.equal(random_tensor("x.q_proj.bias", (8,), 0.02, 0), torch.zeros(8, dtype=torch.bfloat16))


def test_bad_names_are_refused_in_one_line(tmp_path, capsys):
    """An unknown model name (the writer's command) or scale arm is refused before any work."""
    from benchmarks.suites.quantize import SuiteOptions
    from benchmarks.suites.scale import _selection
    from cpu_quant.models.shapes import main

    with pytest.raises(SystemExit) as exit_:
        main(["Bogus"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    for bad in ("Bogus", "Llama-3.2-1B:bogus"):
        with pytest.raises(ValueError, match="unknown arm"):
            _selection(SuiteOptions(smoke=False, workdir=tmp_path, arms=[bad]))
    assert _selection(SuiteOptions(smoke=False, workdir=tmp_path, arms=["Llama-3.2-1B:serve"])) \
        == {"Llama-3.2-1B": ("serve",)}
    # a bare name runs every part; the phone part only at 1B unless named
    every = _selection(SuiteOptions(smoke=False, workdir=tmp_path,
                                    arms=["Llama-3.2-1B", "Llama-3-8B", "Llama-3.2-3B:phone"]))
    assert every == {"Llama-3.2-1B": ("quantize", "serve", "checks", "rerun", "phone"),
                     "Llama-3-8B": ("quantize", "serve", "checks", "rerun"),
                     "Llama-3.2-3B": ("phone",)}


def test_the_peaked_variant_differs_only_in_its_embedding_outputs_and_final_norm(tmp_path,
                                                                                 demo_src):
    """The peaked variant (for export-phone's verification at size) has the same shapes and
    every tensor of the plain model but the embedding, normal with std 1, the output
    projections of the residual branches, with std / sqrt(2 x layers), each from the same
    generator, and the final norm's weight; it says so in its config."""
    import math

    from safetensors.torch import load_file

    from cpu_quant.models.shapes import (
        PEAKED_FINAL_NORM,
        PEAKED_STD,
        PEAKED_VERSION,
        PublicShape,
        write_random_model,
    )

    small = PublicShape("Small", "llama", "LlamaForCausalLM", 64, 128, 2, 4, 2, 512, True, 256,
                        10000.0, 1e-5, extra={"attention_bias": False, "mlp_bias": False})
    plain = write_random_model(small, tmp_path / "plain", demo_src, progress=False)
    peaked = write_random_model(small, tmp_path / "peaked", demo_src, progress=False, peaked=True)
    a = {k: v for f in sorted(plain.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(peaked.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert a.keys() == b.keys() and "lm_head.weight" not in a  # tied
    name = "model.embed_tokens.weight"
    outputs = {k for k in a if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))}
    assert len(outputs) == 2 * small.layers
    norm = "model.norm.weight"
    assert all(torch.equal(a[k], b[k]) for k in a if k not in {name, norm, *outputs})
    assert torch.equal(b[norm], torch.full_like(a[norm], PEAKED_FINAL_NORM))
    assert float(a[name].float().std()) == pytest.approx(0.02, rel=0.1)
    assert float(b[name].float().std()) == pytest.approx(PEAKED_STD, rel=0.1)
    # the same draws, scaled: the variant is the plain model's embedding times 50
    assert torch.allclose(b[name].float(), a[name].float() * (PEAKED_STD / 0.02), rtol=0.02)
    shrink = 1 / math.sqrt(2 * small.layers)
    for k in outputs:
        assert torch.allclose(b[k].float(), a[k].float() * shrink, rtol=0.02), k
    cfg = json.loads((peaked / "config.json").read_text())["cpu_quant_random_model"]
    assert cfg["peaked_std"] == PEAKED_STD and cfg["peaked_version"] == PEAKED_VERSION
    assert cfg["final_norm"] == PEAKED_FINAL_NORM
    assert cfg["residual_output_std"] == pytest.approx(0.02 * shrink)
    assert "peaked_std" not in json.loads((plain / "config.json").read_text())["cpu_quant_random_model"]


def test_a_tiny_model_of_a_smaller_vocabulary_gets_the_demo_tokenizer_cut_to_it(tmp_path, demo_src):
    """A tiny model of fewer tokens than the demo's has a tokenizer of its size: every id it
    gives fits the embedding, text still round-trips (the byte alphabet is kept), the special
    tokens keep their ids; at the demo's size the tokenizer is the demo's file."""
    from transformers import AutoTokenizer

    from cpu_quant.models.tiny import DEMO_BYTES_END, make_tiny_model, truncated_bpe

    small = make_tiny_model("llama", tmp_path / "small", demo_src, vocab=1024)
    tok = AutoTokenizer.from_pretrained(str(small))
    text = "It is a truth universally acknowledged — naïve 日本 code: x = f(y) + 42;\n"
    ids = tok(text)["input_ids"]
    assert max(ids) < 1024 and tok.decode(ids) == text
    assert len(tok) == 1024 and tok.convert_tokens_to_ids("<|im_start|>") == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert max(tok(chat)["input_ids"]) < 1024 and tok(chat)["input_ids"][0] == 1
    full = make_tiny_model("llama", tmp_path / "full", demo_src)
    assert (full / "tokenizer.json").read_bytes() == (demo_src / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="byte alphabet"):
        truncated_bpe(json.loads((demo_src / "tokenizer.json").read_text()), DEMO_BYTES_END - 1)


def test_scale_phone_part_exports_the_peaked_variant_with_the_1b_recipe(tmp_path, monkeypatch):
    """The phone part needs no quantize output; it runs the phone suite's 8da4w arm with an
    8-bit head on the peaked variant, with the GPTQ run on the suite's calibration size."""
    from benchmarks.suites import phone, scale
    from benchmarks.suites.quantize import SuiteOptions
    from cpu_quant.models import shapes

    asked = []
    monkeypatch.setattr(shapes, "random_model_path",
                        lambda name, peaked=False, **kw: asked.append((name, peaked)) or tmp_path)
    suites = scale.build(SuiteOptions(smoke=False, workdir=tmp_path, arms=["Llama-3.2-1B:phone"]))
    assert [s.name for s in suites] == ["scale-phone-Llama-3.2-1B"] and asked[-1] == ("Llama-3.2-1B", True)
    (arm,) = suites[0].arms
    assert arm.name == scale.PHONE_ARM and arm.settings["scheme"] == "8da4w"
    assert arm.settings["head_bits"] == 8 and arm.settings["group_size"] == 32
    assert phone.ARM_SETTINGS[scale.PHONE_ARM] == {"head_bits": 8}
    samples, seqlen = scale.CALIBRATION["Llama-3.2-1B"]
    assert (suites[0].settings["gptq_samples"], suites[0].settings["gptq_seqlen"]) == (samples, seqlen)


def test_scale_checks_parts_refuse_a_missing_artifact_and_compare_every_tensor(tmp_path):
    """The checks and rerun parts run on the quantize part's output: without it they are
    refused before any work; what they compare is every tensor of every safetensors file and
    every GGUF file's bytes, so one changed element is a difference."""
    import torch
    from safetensors.torch import save_file

    from benchmarks.scale_checks import _differing, tensor_digests
    from benchmarks.suites.quantize import SuiteOptions
    from benchmarks.suites.scale import build

    assert _selection_parts(tmp_path) == {"Llama-3.2-1B": ("checks", "rerun")}
    with pytest.raises(ValueError, match="needs the quantize part's output"):
        build(SuiteOptions(smoke=False, workdir=tmp_path, arms=["Llama-3.2-1B:checks"]))
    for name in ("a", "b"):
        (tmp_path / name / "gptq").mkdir(parents=True)
        save_file({"w": torch.arange(6, dtype=torch.int32)}, tmp_path / name / "gptq" / "m.safetensors")
        (tmp_path / name / "gguf").mkdir()
        (tmp_path / name / "gguf" / "m.gguf").write_bytes(b"GGUF-1")
    a, b = tensor_digests(tmp_path / "a"), tensor_digests(tmp_path / "b")
    assert set(a) == {"gptq/w", "gguf/m.gguf"} and not _differing(a, b)
    save_file({"w": torch.tensor([0, 1, 2, 3, 4, 6], dtype=torch.int32)},
              tmp_path / "b" / "gptq" / "m.safetensors")
    (tmp_path / "b" / "gguf" / "m.gguf").write_bytes(b"GGUF-2")
    assert _differing(a, tensor_digests(tmp_path / "b")) == ["gguf/m.gguf", "gptq/w"]


def _selection_parts(tmp_path):
    from benchmarks.suites.quantize import SuiteOptions
    from benchmarks.suites.scale import _selection

    return _selection(SuiteOptions(smoke=False, workdir=tmp_path,
                                   arms=["Llama-3.2-1B:checks", "Llama-3.2-1B:rerun"]))


def test_scale_phone_line_states_a_killed_export_with_its_peak():
    """The committed 1B phone run, whose export the out-of-memory killer stopped: the results
    page's line says it did not finish, how, and at what peak, not that it measured nothing."""
    from pathlib import Path

    from benchmarks.suites.scale import _phone_line

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / \
        "scale-phone-Llama-3.2-1B-20261207T085654Z.json"
    doc = json.loads(path.read_text())
    line = _phone_line("Llama-3.2-1B", doc, "LINK")
    peak = doc["builds"]["8da4w-head8"]["rss"]["peak_rss_anon_bytes"] / 2**30
    assert "did not finish: killed (SIGKILL)" in line and f"{peak:.2f} GiB" in line, line
    assert "GPTQ on 16 x 512 tokens" in line and line.rstrip().endswith(".")
    doc["builds"]["8da4w-head8"]["exit_status"] = 0  # a build that finished but no pass did
    assert "no pass finished" in _phone_line("Llama-3.2-1B", doc, "LINK")
