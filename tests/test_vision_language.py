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


# -- image calibration (--image-samples) ----------------------------------------------------------
@torch.no_grad()
def test_an_image_window_is_what_the_model_feeds_its_language_model(tiny_vlm):
    """``image_windows``: the embeddings of an image window equal those the whole model (the
    transformers Idefics3, float32) hands its language model for the same prompt and image:
    the processor's layout, the vision tower, the projector and the merge, as the model does
    them; the window's text follows the prompt."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from cpu_quant.data.images import load_images
    from cpu_quant.quantize.image_calibration import image_prompt, image_windows

    window = list(range(100, 164))
    ckpt = open_checkpoint(tiny_vlm)
    try:
        (ours,) = image_windows(tiny_vlm, ckpt, [window], 48, None, torch.float32)
    finally:
        ckpt.close()
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    inputs = processor(text=[image_prompt(processor)], images=[load_images(None, 1)],
                       return_tensors="pt", do_image_splitting=False)
    n = inputs["input_ids"].shape[1]
    assert ours.shape == (48, 128) and (inputs["input_ids"] == 49153).sum() == 4
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    seen = {}
    hook = model.model.text_model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True)
    ids = torch.cat([inputs["input_ids"], torch.tensor([window[: 48 - n]])], dim=1)
    model(input_ids=ids, pixel_values=inputs["pixel_values"],
          pixel_attention_mask=inputs["pixel_attention_mask"])
    hook.remove()
    assert torch.equal(ours, seen["embeds"][0])


@pytest.mark.e2e  # a whole quantization of the tiny vision-language model
def test_image_calibration_reaches_the_codes_and_is_stated(tiny_vlm, tmp_path):
    """With ``--image-samples`` the image windows' activations enter the Hessians: the codes
    differ from the text-only run's of the same windows and settings; the report, the card and
    the summary say how the run calibrated."""
    base = ["--samples", "8", "--seqlen", "48", "--no-smooth", "--no-eval"]
    text = invoke(["gptq", tiny_vlm, tmp_path / "text", *base])
    images = invoke(["gptq", tiny_vlm, tmp_path / "images", *base, "--image-samples", "4"])
    assert text.exit_code == 0 and images.exit_code == 0, images.stderr
    a, b = _tensors(tmp_path / "text"), _tensors(tmp_path / "images")
    qweights = [n for n in a if n.endswith(".qweight")]
    assert sum(not torch.equal(a[n], b[n]) for n in qweights) >= len(qweights) // 2
    report = json.loads((tmp_path / "images" / "quantization_report.json").read_text())
    assert report["vision_language"]["calibration"].startswith("with images: 4 of 8 windows")
    assert report["calibration_tokens"] == 8 * 48
    card = (tmp_path / "images" / "README.md").read_text()
    assert "4 of the windows begin with an image (the built-in images)" in card
    assert "calibration with images" in images.stderr + images.stdout


@pytest.mark.parametrize("args, needle", [
    (["--image-samples", "9", "--samples", "8"], "--image-samples 9 is more than --samples 8"),
    (["--images", "IMAGES"], "--images applies with --image-samples"),
    (["--image-samples", "2", "--images", "EMPTY"], "no .jpg, .jpeg, .png, .webp file"),
    (["--image-samples", "-1"], "--image-samples must be >= 0"),
    (["--image-samples", "2", "--images", "MISSING"], "MISSING: not a directory"),
    (["--image-samples", "2", "--images", "BAD"], "bad.jpg is not a readable image"),
])
def test_image_calibration_refusals_are_one_line(tiny_vlm, tmp_path, args, needle):
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "BAD").mkdir()
    (tmp_path / "BAD" / "bad.jpg").write_text("not an image")
    args = [str(tmp_path / a) if a in ("EMPTY", "IMAGES", "MISSING", "BAD") else a
            for a in args]
    out = invoke(["gptq", tiny_vlm, tmp_path / "out", "--no-eval", *args])
    assert out.exit_code != 0 and not out.traceback, out.stderr
    assert len(out.error_lines) == 1 and needle in out.error_lines[0], out.stderr
    assert not (tmp_path / "out").exists()


def test_image_calibration_without_the_processors_config_is_refused_in_one_line(tiny_vlm,
                                                                                   tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_vlm, src)
    (src / "processor_config.json").unlink()
    out = invoke(["gptq", src, tmp_path / "out", "--no-eval", "--samples", "4", "--seqlen",
                  "48", "--image-samples", "2"])
    assert out.exit_code != 0 and not out.traceback, out.stderr
    assert len(out.error_lines) == 1, out.stderr
    assert "the checkpoint's processor cannot be built here" in out.error_lines[0]
    assert not (tmp_path / "out").exists()


def test_image_calibration_of_a_text_model_is_refused_in_one_line(demo_src, tmp_path):
    out = invoke(["gptq", demo_src, tmp_path / "out", "--no-eval", "--image-samples", "2"])
    assert out.exit_code != 0 and not out.traceback, out.stderr
    assert len(out.error_lines) == 1 and "vision-language models only" in out.error_lines[0]


# -- GGUF: the language model's file and llama.cpp's projector file ------------------------------
@pytest.fixture(scope="session")
def tiny_vlm_formats(tiny_vlm: Path, tmp_path_factory) -> Path:
    """One run writing GPTQ and GGUF (the same codes): ``<dst>/gptq`` and ``<dst>/gguf``."""
    from cpu_quant.formats import get_format

    dst = tmp_path_factory.mktemp("vlm-formats") / "out"
    quantize_checkpoint(tiny_vlm, dst, SETTINGS, [get_format("gptq"), get_format("gguf")],
                        progress=False)
    return dst


def _gguf_files(directory: Path) -> tuple[Path, Path]:
    files = sorted(directory.glob("*.gguf"))
    mmproj = [f for f in files if f.name.startswith("mmproj-")]
    model = [f for f in files if not f.name.startswith("mmproj-")]
    assert len(mmproj) == 1 and len(model) == 1, files
    return model[0], mmproj[0]


@pytest.mark.e2e  # a whole quantization of the tiny vision-language model
def test_gguf_writes_the_language_model_and_the_projector_file(tiny_vlm, tiny_vlm_formats):
    """The model file is a Llama decoder (the checkpoint's ``model.text_model.`` read as
    ``model.``) with every linear and the head Q4_0, and nothing of the vision tower; the
    projector file holds the 38 kept tensors with the source's values (BF16 weights bit for
    bit, F32 norms, biases and embeddings), named and typed as llama.cpp's converter does, and
    the ``clip`` keys of an Idefics3 projector; verify and inspect read both."""
    import gguf

    from cpu_quant.formats.gguf import reader as gguf_reader
    from cpu_quant.verify.checks import verify_checkpoint
    from cpu_quant.verify.inspect import inspect_checkpoint
    from cpu_quant.verify.source import compare_with_source

    model, mmproj = _gguf_files(tiny_vlm_formats / "gguf")
    r = gguf.GGUFReader(model)
    assert r.get_field("general.architecture").contents() == "llama"
    assert not any(t.name.startswith(("v.", "mm.")) for t in r.tensors)
    modules = gguf_reader.unpack(model)
    assert len(modules) == 2 * 7 + 1 and "lm_head" in modules
    assert all(m.startswith("model.text_model.layers.") for m in modules if m != "lm_head")
    p = gguf.GGUFReader(mmproj)
    keys = {k: f.contents() for k, f in p.fields.items() if not k.startswith("GGUF.")}
    assert keys["general.architecture"] == "clip" and keys["general.type"] == "mmproj"
    assert keys["clip.projector_type"] == "idefics3" and keys["clip.vision.projection_dim"] == 128
    assert keys["clip.vision.projector.scale_factor"] == 2
    assert keys["clip.vision.image_size"] == keys["clip.vision.preproc_image_size"] == 56
    types = {t.name: t.tensor_type.name for t in p.tensors}
    assert len(types) == 38 and types["mm.model.fc.weight"] == "BF16"
    assert types["v.patch_embd.weight"] == types["v.position_embd.weight"] == "F32"
    assert types["v.blk.1.attn_q.weight"] == "BF16" and types["v.blk.1.ln2.bias"] == "F32"

    report = verify_checkpoint(tiny_vlm_formats / "gguf")
    assert not [f for f in report.findings if f.severity == "error"], report.findings
    assert any(f.check == "mmproj" and "idefics3" in f.message for f in report.findings)
    summary = inspect_checkpoint(tiny_vlm_formats / "gguf")
    assert summary.summary["mmproj"]["tensors"] == 38, summary
    findings, source = compare_with_source(tiny_vlm_formats / "gguf", tiny_vlm)
    assert not findings and source["kept_tensors"] == 38 and source["modules"] == 15, findings


@pytest.mark.e2e  # a whole quantization of the tiny vision-language model
def test_verify_refuses_a_projector_file_missing_a_tensor_or_cut_short(tiny_vlm, tiny_vlm_formats,
                                                                      tmp_path):
    """A projector file without the projector's weight, or truncated, is an error; and
    ``verify --source`` names a kept tensor changed in its last bit."""
    import gguf

    from cpu_quant.verify.checks import verify_checkpoint
    from cpu_quant.verify.source import compare_with_source
    from tests.helpers.gguf_edit import copy_without_tensor

    _, mmproj = _gguf_files(tiny_vlm_formats / "gguf")
    short = tmp_path / "short"
    shutil.copytree(tiny_vlm_formats / "gguf", short)
    cut = short / mmproj.name
    cut.write_bytes(cut.read_bytes()[:-1000])
    errors = [f for f in verify_checkpoint(short).findings if f.severity == "error"]
    assert errors and all(f.check.startswith("mmproj") for f in errors), errors

    changed = tmp_path / "changed"
    shutil.copytree(tiny_vlm_formats / "gguf", changed)
    data = bytearray((changed / mmproj.name).read_bytes())
    t = next(t for t in gguf.GGUFReader(mmproj).tensors if t.name == "mm.model.fc.weight")
    data[int(t.data_offset)] ^= 1  # the lowest bit of its first BF16 value
    (changed / mmproj.name).write_bytes(bytes(data))
    findings, _ = compare_with_source(changed, tiny_vlm)
    assert [f.tensor for f in findings] == ["model.connector.modality_projection.proj.weight"]

    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_vlm_formats / "gguf", renamed)
    copy_without_tensor(mmproj, renamed / mmproj.name, "mm.model.fc.weight")
    errors = [f for f in verify_checkpoint(renamed).findings if f.severity == "error"]
    assert [(f.check, f.tensor) for f in errors] == [("mmproj-tensor", "mm.model.fc.weight")]


def test_gguf_without_the_image_processors_settings_is_refused_before_work(tiny_vlm, tmp_path):
    """The projector file needs the image processor's mean and std: a checkpoint without its
    processor config is refused in one line before any work, nothing written."""
    src = tmp_path / "src"
    shutil.copytree(tiny_vlm, src)
    (src / "processor_config.json").unlink()
    out = invoke(["gptq", src, tmp_path / "out", "--format", "gguf", "--no-eval"])
    assert out.exit_code != 0 and not out.traceback, out.stderr
    assert len(out.error_lines) == 1, out.stderr
    assert "--format gguf:" in out.error_lines[0] and "image_mean" in out.error_lines[0]
    assert "layers" not in out.stderr  # refused before the first layer
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e  # a whole quantization of the tiny vision-language model
def test_the_projector_file_is_llama_cpps_converters(tiny_vlm, tiny_vlm_formats, tmp_path):
    """Against llama.cpp's own converter (``convert_hf_to_gguf.py --mmproj --outtype bf16``
    of the same source, from the llama-cpp-python source the peer build holds): the same
    tensors in the same order, types and bytes, and the same metadata but the name the
    converter derives from the directory and its size label."""
    import gguf
    import numpy as np

    from benchmarks.peers.llama_cpp_env import _CONVERT, CONVERT_PRE_TOKENIZER, ready_env

    env = ready_env()
    if env is None:
        pytest.skip("llama-cpp-python peer venv not built (python -m benchmarks.peers.llama_cpp_env)")
    ref = tmp_path / "ref-mmproj.gguf"
    proc = subprocess.run([sys.executable, "-c", _CONVERT,
                           str(env.path / "llama.cpp" / "convert_hf_to_gguf.py"),
                           CONVERT_PRE_TOKENIZER, str(tiny_vlm), "--mmproj", "--outtype", "bf16",
                           "--outfile", str(ref)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, mmproj = _gguf_files(tiny_vlm_formats / "gguf")
    theirs, ours = gguf.GGUFReader(ref), gguf.GGUFReader(mmproj)
    skip = ("GGUF.", "general.name", "general.size_label")
    kt = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith(skip)}
    ko = {k: f.contents() for k, f in ours.fields.items() if not k.startswith(skip)}
    assert ko == kt
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert np.array_equal(np.array(a.data), np.array(b.data)), a.name


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


# -- end-to-end: real llama.cpp with an image (libmtmd) -----------------------------------------
IMAGE_SIDE = 56  # the tiny model's tile: llama.cpp's overview and its one slice are this image


@torch.no_grad()
def _llama_cpp_against_torch(dst: Path, tmp_path: Path, seed: int) -> tuple[list[int], float]:
    """llama.cpp's run of the GGUF pair on the image of ``seed`` against the torch model that
    holds the same weights (the GPTQ artifact of the same run, its embedding replaced by the
    GGUF's Q8_0 one) fed llama.cpp's own token layout and the same pixels. Returns llama.cpp's
    greedy tokens and the largest logit difference, after checking the image embeddings and
    every greedy step."""
    import gguf
    import numpy as np

    from benchmarks.peers.llama_cpp_env import ready_env
    from cpu_quant.eval.dequantized import load_model

    env = ready_env()
    if env is None:
        pytest.skip("llama-cpp-python peer venv not built (python -m benchmarks.peers.llama_cpp_env)")
    model_file, mmproj = _gguf_files(dst / "gguf")
    pixels = np.random.RandomState(seed).randint(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3),
                                                 dtype=np.uint8)
    np.save(tmp_path / f"image-{seed}.npy", pixels)
    out = tmp_path / f"llama-cpp-{seed}.npz"
    proc = subprocess.run([str(env.python), str(REPO / "tests" / "helpers" / "llama_cpp_images.py"),
                           str(model_file), str(mmproj), str(tmp_path / f"image-{seed}.npy"),
                           "User:<__media__>What is in this image?", str(out), str(REPO),
                           str(NEW_TOKENS)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    arrays = np.load(out)

    model = load_model(dst / "gptq", torch.float32)
    emb = next(t for t in gguf.GGUFReader(model_file).tensors if t.name == "token_embd.weight")
    model.get_input_embeddings().weight.data = torch.from_numpy(
        gguf.quants.dequantize(np.array(emb.data), emb.tensor_type).copy()).float()
    ids, images = [], 0
    for chunk in result["chunks"]:
        if chunk["type"] == "text":
            ids += chunk["tokens"]
        else:
            ids += [model.config.image_token_id] * chunk["n_tokens"]
            images += 1
    assert images == 2  # the overview and one slice, as Idefics3's processor splits
    x = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    pixel_values = x.expand(1, images, *x.shape).contiguous()
    features = model.model.get_image_features(pixel_values=pixel_values)
    features = getattr(features, "pooler_output", features).reshape(images, -1, 128)
    for i, key in enumerate(k for k in arrays.files if k.startswith("image_")):
        theirs = torch.from_numpy(arrays[key])
        rel = ((theirs - features[i]).norm() / features[i].norm()).item()
        # llama.cpp runs the BF16 weights with bf16-rounded activations, torch in float32
        assert rel < 0.01, (key, rel)
    diffs, steps = [], []
    generated = result["generated"]
    for s, token in enumerate(generated):
        logits = model(input_ids=torch.tensor([ids + generated[:s]]),
                       pixel_values=pixel_values).logits[0, -1]
        diffs.append((logits - torch.from_numpy(arrays["logits"][s])).abs().max().item())
        best = int(logits.argmax())
        steps.append((best, float(logits[best] - logits[token])))
    diff = max(diffs)
    print(f"llama.cpp vs torch, image {seed}: largest logit difference {diff:.3f}; llama.cpp "
          f"{generated}, torch at its prefixes {[b for b, _ in steps]}")
    assert diff < 1.5  # Q8_0 activations in llama.cpp; a layout error moves logits by far more
    for s, (best, gap) in enumerate(steps):  # torch's choice, or a near tie within the rounding
        assert best == generated[s] or gap <= 2 * diff, (s, best, gap)
    return generated, diff


@pytest.mark.e2e
def test_llama_cpp_runs_the_gguf_and_projector_file_with_an_image(tiny_vlm_formats, tmp_path):
    """Real llama.cpp (libmtmd) loads the language model's GGUF and the projector file, lays
    out the image as Idefics3 does (an overview and its slice), and computes the image
    embeddings of the torch model (relative error under 1 %) and its greedy tokens; two
    images give different continuations, so the image reaches the tokens compared."""
    first, _ = _llama_cpp_against_torch(tiny_vlm_formats, tmp_path, 1)
    second, _ = _llama_cpp_against_torch(tiny_vlm_formats, tmp_path, 2)
    assert first != second
