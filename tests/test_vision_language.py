"""Vision-language checkpoints (``core.vision_language``): a tiny random Idefics3 (SmolVLM).

Unit tier: the plan keeps the vision tower and the projector; a run copies their tensors bit for
bit and quantizes every linear of the language model and the head; verify, inspect and the
report say which were kept and why; refusals are one line. End-to-end tier: real vLLM serves
the GPTQ artifact with image prompts, greedy tokens equal to the dequantized torch model's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_quant.core.io.checkpoint import open_checkpoint
from cpu_quant.core.vision_language import FAMILIES, family_of
from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint
from cpu_quant.quantize.plan import kept_rules, plan_kept

from .conftest import REPO, needs_vllm_gptq_kernel
from .helpers.vllm_generate_images import random_image
from .helpers.vllm_paths import NEAR_TIE_NATS, reference_context, vllm_gptq_path
from .hostile.generate import invoke

KEPT = ("model.vision_model.", "model.connector.")
NEW_TOKENS = 8
# a tiny run: the plan and the layout are what is tested here, not the fidelity
SETTINGS = QuantSettings(samples=4, seqlen=32, batch_size=2, smooth=False)


@pytest.fixture(scope="session")
def tiny_vlm(demo_src: Path, tmp_path_factory) -> Path:
    from cpu_quant.models.tiny import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "src", demo_src)


@pytest.fixture(scope="session")
def tiny_vlm_gptq(tiny_vlm: Path, tmp_path_factory) -> tuple[Path, object]:
    dst = tmp_path_factory.mktemp("vlm-gptq") / "out"
    report = quantize_checkpoint(tiny_vlm, dst, SETTINGS, progress=False)
    return dst, report


@pytest.fixture(scope="session")
def tiny_vlm_cpu_int4(tiny_vlm: Path, tmp_path_factory) -> Path:
    from cpu_quant.formats import get_format

    dst = tmp_path_factory.mktemp("vlm-cpu-int4") / "out"
    report = quantize_checkpoint(tiny_vlm, dst, SETTINGS, [get_format("cpu_int4")],
                                 progress=False)
    return Path(report.outputs["cpu_int4"])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    ckpt = open_checkpoint(path)
    try:
        return {n: ckpt.tensor(n) for n in ckpt.names}
    finally:
        ckpt.close()


def test_the_plan_keeps_the_vision_tower_and_projector(tiny_vlm):
    ckpt = open_checkpoint(tiny_vlm)
    family = family_of(ckpt.config)
    assert family is FAMILIES["idefics3"]
    kept = plan_kept(family, {n: ckpt.shape(n) for n in ckpt.names})
    assert [k.prefix for k in kept] == list(KEPT)
    assert all(k.tensors > 0 and k.parameters > 0 for k in kept)
    # the rules match vLLM's names of these modules (its fused ones too), and no other
    patterns = [p.removeprefix("-:") for p in kept_rules(kept)]
    for name in ("model.vision_model.encoder.layers.0.self_attn.qkv_proj",
                 "model.vision_model.encoder.layers.1.mlp.fc2",
                 "model.connector.modality_projection.proj"):
        assert any(re.match(p, name) for p in patterns), name
    for name in ("model.text_model.layers.0.self_attn.qkv_proj", "lm_head"):
        assert not any(re.match(p, name) for p in patterns), name


def test_the_stream_runs_the_language_model_alone(tiny_vlm):
    """The vision encoder's layers are as many as the decoder's: the stream takes the
    decoder's, and loads no tensor of the kept modules (calibration is image-free)."""
    from cpu_quant.quantize.streaming import LayerStream

    stream = LayerStream(open_checkpoint(tiny_vlm))
    assert stream.layers_prefix == "model.text_model.layers"
    assert all(n.startswith("model.text_model.layers.0.") for n in stream.linears(0))
    vision = [p for n, p in stream.model.named_parameters() if n.startswith(KEPT)]
    assert vision and all(p.is_meta for p in vision)


def test_kept_tensors_are_copied_bit_identical_and_the_language_model_quantized(
        tiny_vlm, tiny_vlm_gptq):
    dst, report = tiny_vlm_gptq
    src, out = _tensors(tiny_vlm), _tensors(dst)
    kept = [n for n in src if n.startswith(KEPT)]
    assert len(kept) == 38
    for n in kept:
        assert out[n].dtype == src[n].dtype == torch.bfloat16, n
        assert torch.equal(out[n].view(torch.int16), src[n].view(torch.int16)), n
    assert not any(n.startswith(KEPT) and n.endswith(".qweight") for n in out)
    linears = {n.removesuffix(".weight") for n in src
               if n.startswith("model.text_model.layers.") and n.endswith("_proj.weight")}
    assert len(linears) == 2 * 7
    for m in [*linears, "lm_head"]:
        assert f"{m}.qweight" in out and f"{m}.weight" not in out, m
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert {r"-:model\.vision_model\.", r"-:model\.connector\."} <= set(qcfg["dynamic"])
    vl = report.vision_language
    assert vl["family"] == "Idefics3 (SmolVLM)" and vl["calibration"].startswith("image-free")
    assert [k["prefix"] for k in vl["kept"]] == list(KEPT)
    assert (dst / "processor_config.json").is_file()


def test_verify_and_inspect_name_what_was_kept(tiny_vlm_gptq):
    from cpu_quant.verify.checks import verify_checkpoint
    from cpu_quant.verify.inspect import inspect_checkpoint

    dst, _ = tiny_vlm_gptq
    report = verify_checkpoint(dst)
    assert not [f for f in report.findings if f.severity == "error"], report.findings
    vl = [f for f in report.findings if f.check == "vision-language"]
    assert [f.tensor for f in vl] == [None, "model.vision_model.*", "model.connector.*"]
    assert "15 quantized linears" in vl[0].message and "vision tower" in vl[1].message
    rows = {k["prefix"]: k for k in inspect_checkpoint(dst).kept}
    assert rows["model.vision_model."]["quantized"] == 0
    assert rows["model.vision_model."]["dtypes"] == ["BF16"]
    assert rows["model.connector."]["tensors"] == 1


def test_verify_finds_a_vision_linear_without_its_negative_rule(tiny_vlm_gptq, tmp_path):
    """Without the rule, vLLM would build the vision tower's linears as GPTQ layers: verify
    reports every one of them (the kept modules' rules are what keeps them bf16)."""
    from cpu_quant.verify.checks import verify_checkpoint

    dst, _ = tiny_vlm_gptq
    broken = tmp_path / "broken"
    shutil.copytree(dst, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["quantization_config"]["dynamic"][r"-:model\.vision_model\."]
    (broken / "config.json").write_text(json.dumps(config))
    errors = [f for f in verify_checkpoint(broken).findings if f.severity == "error"]
    assert errors and all(f.check == "completeness" and f.tensor.startswith("model.vision_model.")
                          for f in errors), errors
    assert len(errors) == 2 * 6  # 2 layers x q, k, v, out, fc1, fc2


def test_verify_source_holds_the_kept_tensors_to_the_source_bit_for_bit(
        tiny_vlm, tiny_vlm_gptq, tmp_path):
    """``verify --source``: the kept tensors equal the source's; one changed in its last bit
    (a bf16 step of one element) is an error naming it."""
    from safetensors.torch import load_file, save_file

    from cpu_quant.verify.source import compare_with_source

    dst, _ = tiny_vlm_gptq
    findings, summary = compare_with_source(dst, tiny_vlm)
    assert not findings and summary["kept_tensors"] == 38, findings
    broken = tmp_path / "broken"
    shutil.copytree(dst, broken)
    name = "model.connector.modality_projection.proj.weight"
    shard = broken / json.loads((broken / "model.safetensors.index.json").read_text())[
        "weight_map"][name]
    tensors = load_file(str(shard))
    bits = tensors[name].view(torch.int16).clone()
    bits.view(-1)[0] ^= 1
    tensors[name] = bits.view(torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    findings, _ = compare_with_source(broken, tiny_vlm)
    assert [f.tensor for f in findings] == [name], findings


@pytest.mark.parametrize("key, value, needle", [
    ("num_hidden_layers", 10**9, "text_config.num_hidden_layers is 1000000000, the checkpoint holds 2"),
    ("vocab_size", 7, "text_config.vocab_size is 7, model.text_model.embed_tokens.weight"),
])
def test_a_language_model_config_its_tensors_contradict_is_refused_before_the_build(
        tiny_vlm, tmp_path, key, value, needle):
    """A config stating a billion decoder layers is refused from the header, before a model
    is built from it (building one would hang), as for a decoder-only model."""
    src = tmp_path / "src"
    shutil.copytree(tiny_vlm, src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"][key] = value
    (src / "config.json").write_text(json.dumps(config))
    out = invoke(["gptq", src, tmp_path / "out", "--no-eval"])
    assert out.exit_code != 0 and not out.traceback, out.stderr
    assert len(out.error_lines) == 1 and needle in out.error_lines[0], out.stderr


def test_gguf_of_a_vision_language_model_is_refused_in_one_line(tiny_vlm, tmp_path):
    out = invoke(["gptq", tiny_vlm, tmp_path / "out", "--format", "gptq,gguf", "--no-eval"])
    assert out.exit_code != 0 and not out.traceback, out.stderr
    assert len(out.error_lines) == 1 and "mmproj" in out.error_lines[0], out.stderr
    assert not (tmp_path / "out").exists()


def test_another_vision_language_family_is_refused_in_one_line(tiny_vlm, tmp_path):
    src = tmp_path / "qwen2_5_vl"
    shutil.copytree(tiny_vlm, src)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"])
    (src / "config.json").write_text(json.dumps(config))
    out = invoke(["gptq", src, tmp_path / "out", "--no-eval"])
    assert out.exit_code != 0 and not out.traceback, out.stderr
    assert len(out.error_lines) == 1, out.stderr
    assert "qwen2_5_vl vision-language checkpoint" in out.error_lines[0], out.error_lines


# -- end-to-end: real vLLM with image prompts ---------------------------------------------------
PROMPTS = [{"prompt": "User:<image>What is in this image?", "image_seed": 1},
           {"prompt": "User:<image>What is in this image?", "image_seed": 2}]


def _vllm_image_greedy(model_dir: Path, tmp_path: Path) -> tuple[list[dict], str]:
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_PLUGINS", None)  # the cpu_quant plugin serves GPTQ on this CPU
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "vllm_generate_images.py"),
                           str(model_dir), str(prompts_file), str(NEW_TOKENS)],
                          capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout + proc.stderr


@torch.no_grad()
def _reference_greedy(model, inputs: dict, new_tokens: int) -> list[int]:
    """Greedy tokens of the torch model, the image's features in every forward (no cache: the
    tiny model recomputes the whole sequence)."""
    ids = inputs["input_ids"]
    for _ in range(new_tokens):
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"],
                       pixel_attention_mask=inputs["pixel_attention_mask"]).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.vllm
@needs_vllm_gptq_kernel
def test_vllm_serves_the_gptq_artifact_with_an_image_like_its_dequantized_weights(
        tiny_vlm_gptq, tmp_path):
    """vLLM loads the artifact (the language model GPTQ, the vision tower and projector bf16
    by the negative rules), expands the image placeholder as the artifact's processor does,
    and generates the greedy tokens of the torch model holding the dequantized weights, up to
    the first near-tie (``_assert_greedy_matches_dequantized``'s rule). The two images give the
    torch model different continuations: the image reaches the tokens compared."""
    dst, _ = tiny_vlm_gptq
    _assert_served_like_dequantized(dst, tmp_path, ("auto_gptq", "gptq"), vllm_gptq_path())


@pytest.mark.vllm
def test_vllm_serves_the_cpu_int4_artifact_with_an_image_like_its_dequantized_weights(
        tiny_vlm_cpu_int4, tmp_path):
    """The same for cpu_int4: the plugin's method honours the same negative rules, and its
    tinygemm kernel computes with bf16 activations (the W4A16 near-tie)."""
    _assert_served_like_dequantized(tiny_vlm_cpu_int4, tmp_path, ("cpu_int4",), "w4a16")


def _assert_served_like_dequantized(dst: Path, tmp_path: Path, methods: tuple[str, ...],
                                    path: str) -> None:
    from transformers import AutoProcessor

    from cpu_quant.eval.dequantized import load_model

    results, log = _vllm_image_greedy(dst, tmp_path)
    info = json.loads(next(ln for ln in log.splitlines() if ln.startswith("INFO {"))[5:])
    assert info["quantization"] in methods, info
    processor = AutoProcessor.from_pretrained(dst)
    reference = load_model(dst, torch.bfloat16)
    expected_all = []
    for p, res in zip(PROMPTS, results, strict=True):
        inputs = processor(text=[p["prompt"]], images=[[random_image(p["image_seed"])]],
                           return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == res["prompt_ids"]
        with reference_context(reference, path):
            expected = _reference_greedy(reference, inputs, NEW_TOKENS)
        expected_all.append(expected)
        got = res["tokens"]
        first_diff = next((i for i, (a, b) in enumerate(zip(expected, got, strict=True))
                           if a != b), None)
        if first_diff is not None:
            margin = res["top2_margin"][first_diff]
            assert margin is not None and margin < NEAR_TIE_NATS[path], (
                f"vLLM diverged from the dequantized weights at token {first_diff} with a top-2 "
                f"margin of {margin:.3f} nats: {got} vs {expected}")
    assert expected_all[0] != expected_all[1], expected_all
