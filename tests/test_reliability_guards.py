"""Guards: never destroy or write into the source, never resume into another model, and bad
input ends in one ``error:`` line with nothing left at or beside the output."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import run_cli

RTN = ["--method", "rtn", "--calib", "none", "--group", "32", "--no-eval"]
TINY_CALIB = ["--group", "32", "--samples", "2", "--seqlen", "32", "--batch-size", "1",
              "--no-eval"]


def tree_hash(root: Path) -> str:
    """Every file's relative path and bytes under ``root`` (links not followed)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def one_error_line(proc, needle: str) -> str:
    assert proc.returncode != 0, proc.stdout[-1000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert needle in errors[0], errors[0]
    return errors[0]


def nothing_beside(dst: Path) -> None:
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]
    assert not leftovers, leftovers


@pytest.fixture
def src(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny model, inside a parent holding an unrelated file."""
    parent = tmp_path / "models"
    parent.mkdir()
    (parent / "notes.txt").write_text("not cpu-quant's")
    return Path(shutil.copytree(tiny_llama, parent / "tiny"))


@pytest.fixture(scope="session")
def tiny_gptq(tiny_llama, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("guards") / "tiny-gptq"
    run_cli("gptq", str(tiny_llama), str(dst), *RTN)
    return dst


# -- output paths ----------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["gptq", "tinygemm"])
@pytest.mark.parametrize("where", ["same", "parent", "inside", "link"])
def test_output_may_not_be_at_above_or_inside_the_source(src, tmp_path, command, where):
    before, parent_before = tree_hash(src), tree_hash(src.parent)
    dst = {"same": src, "parent": src.parent, "inside": src / "out",
           "link": tmp_path / "link"}[where]
    if where == "link":
        dst.symlink_to(src)
    proc = run_cli(command, str(src), str(dst), *RTN, "--overwrite", check=False)
    one_error_line(proc, "the source")
    assert tree_hash(src) == before and tree_hash(src.parent) == parent_before
    assert (src.parent / "notes.txt").read_text() == "not cpu-quant's"


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_convert_output_may_not_touch_its_source(tiny_gptq, tmp_path, where):
    src = Path(shutil.copytree(tiny_gptq, tmp_path / "q" / "gptq"))
    before = tree_hash(src.parent)
    dst = {"same": src, "parent": src.parent, "inside": src / "out"}[where]
    proc = run_cli("convert", str(src), str(dst), "--to", "cpu_int4", "--overwrite", check=False)
    one_error_line(proc, "the source")
    assert tree_hash(src.parent) == before


def test_export_phone_output_may_not_be_the_source(src):
    before = tree_hash(src.parent)
    proc = run_cli("export-phone", str(src), str(src.parent), "--backend", "xnnpack",
                   "--overwrite", check=False)
    one_error_line(proc, "contains the source")
    assert tree_hash(src.parent) == before


def test_overwrite_refuses_a_plain_file_and_a_foreign_directory(tiny_llama, tmp_path):
    file_dst = tmp_path / "out.txt"
    file_dst.write_text("mine")
    proc = run_cli("gptq", str(tiny_llama), str(file_dst), *RTN, "--overwrite", check=False)
    one_error_line(proc, "not a directory")
    assert file_dst.read_text() == "mine"
    nothing_beside(file_dst)
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "a.jpg").write_bytes(b"\xff\xd8")
    proc = run_cli("gptq", str(tiny_llama), str(foreign), *RTN, "--overwrite", check=False)
    one_error_line(proc, "not a cpu-quant artifact")
    assert (foreign / "a.jpg").read_bytes() == b"\xff\xd8"
    nothing_beside(foreign)


def test_overwrite_replaces_an_artifact_or_an_empty_directory_leaving_nothing_beside(
        tiny_gptq, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()  # empty: replaceable
    run_cli("convert", str(tiny_gptq), str(dst), "--to", "cpu_int4", "--overwrite")
    nothing_beside(dst)
    (dst / "stale.txt").write_text("old")  # an artifact: replaced whole
    run_cli("convert", str(tiny_gptq), str(dst), "--to", "cpu_int4", "--overwrite")
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] \
        == "cpu_int4"
    assert not (dst / "stale.txt").exists()
    nothing_beside(dst)


def test_eval_json_is_checked_before_the_evaluation(tiny_llama, tiny_gptq, tmp_path):
    before = tree_hash(tiny_gptq)
    missing = tmp_path / "no-such-dir" / "r.json"
    proc = run_cli("eval", str(tiny_gptq), "--reference", str(tiny_llama), "--output-json",
                   str(missing), check=False)
    one_error_line(proc, "does not exist")
    assert "eval windows" not in proc.stderr  # refused before any window was scored
    proc = run_cli("eval", str(tiny_gptq), "--reference", str(tiny_llama), "--output-json",
                   str(tiny_gptq / "r.json"), check=False)
    one_error_line(proc, "inside the source")
    assert tree_hash(tiny_gptq) == before


@pytest.mark.parametrize("flag", ["--prompts", "--windows"])
def test_eval_refuses_zero_prompts_or_windows(tiny_llama, tiny_gptq, flag):
    proc = run_cli("eval", str(tiny_gptq), "--reference", str(tiny_llama), flag, "0", check=False)
    one_error_line(proc, flag)


# -- resume: the same model, the same layer --------------------------------------------------
def _settings():
    from cpu_quant.quantize.settings import QuantSettings

    # what `gptq ... TINY_CALIB` asks for
    return QuantSettings(group_size=32, samples=2, seqlen=32, batch_size=1)


def _interrupted_run(src: Path, dst: Path) -> Path:
    """A run stopped after its first layer, as Ctrl-C leaves it; its staging directory."""
    from cpu_quant.quantize.pipeline import quantize_checkpoint

    def stop(i: int, n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, dst, _settings(), progress=False, on_layer=stop)
    staging = dst.parent / f".{dst.name}.partial"
    assert json.loads((staging / "cpu_quant_state.json").read_text())["completed_layers"] == 1
    return staging


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_resume_refuses_another_model_of_the_same_shapes(demo_src, tiny_llama, tmp_path):
    from .conftest import make_tiny_model

    other = make_tiny_model("llama", tmp_path / "elsewhere" / "llama", demo_src, seed=1)
    dst = tmp_path / "out"
    staging = _interrupted_run(tiny_llama, dst)
    before = tree_hash(staging)
    proc = run_cli("gptq", str(other), str(dst), *TINY_CALIB, "--resume", check=False)
    one_error_line(proc, "cannot resume: the source model's files or tensor contents differ")
    assert tree_hash(staging) == before and not dst.exists()
    proc = run_cli("gptq", str(tiny_llama), str(dst), *TINY_CALIB, "--samples", "3", "--resume",
                   check=False)
    one_error_line(proc, "the settings, formats or compute dtype and the calibration tokens differ")


def test_content_digest_sees_a_changed_tensor_of_the_same_shape(tiny_llama, tmp_path):
    from cpu_quant.io.checkpoint import open_checkpoint

    src = Path(shutil.copytree(tiny_llama, tmp_path / "src"))
    first = open_checkpoint(src).content_digest()
    tensors = load_file(src / "model.safetensors")
    w = tensors["model.layers.1.self_attn.o_proj.weight"]
    tensors["model.layers.1.self_attn.o_proj.weight"] = w.flip(0).contiguous()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert open_checkpoint(src).content_digest() != first


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_resume_after_a_kill_between_the_activations_and_the_state(tiny_llama, tmp_path):
    """The activations of layer 2 are in place, the state still says layer 1 (a kill between
    the two writes): the resume uses layer 1's activations, kept until the state moved on, and
    gives the uninterrupted run's artifact bit for bit."""
    from cpu_quant.io.safetensors_writer import write_safetensors
    from cpu_quant.quantize.pipeline import quantize_checkpoint

    quantize_checkpoint(tiny_llama, tmp_path / "whole", _settings(), progress=False)
    dst = tmp_path / "out"
    staging = _interrupted_run(tiny_llama, dst)
    saved = staging / "cpu_quant_hidden-00001.safetensors"
    from safetensors import safe_open

    with safe_open(str(saved), framework="pt") as fh:
        meta = fh.metadata()
    ahead = {k: v + 1 for k, v in load_file(saved).items()}  # not layer 1's: must not be used
    write_safetensors(staging / "cpu_quant_hidden-00002.safetensors", ahead,
                      metadata={**meta, "completed_layers": "2"})
    run_cli("gptq", str(tiny_llama), str(dst), *TINY_CALIB, "--resume")
    whole, resumed = _tensors(tmp_path / "whole"), _tensors(dst)
    assert sorted(whole) == sorted(resumed)
    for name, t in whole.items():
        assert torch.equal(t, resumed[name]), name
    nothing_beside(dst)


@pytest.mark.parametrize("stamp", [{"completed_layers": "2"}, {"fingerprint": "0" * 64}, {}])
@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_resume_refuses_activations_of_another_layer_or_run(tiny_llama, tmp_path, stamp):
    from safetensors import safe_open

    from cpu_quant.io.safetensors_writer import write_safetensors

    dst = tmp_path / "out"
    staging = _interrupted_run(tiny_llama, dst)
    saved = staging / "cpu_quant_hidden-00001.safetensors"
    with safe_open(str(saved), framework="pt") as fh:
        meta = fh.metadata()
    # {}: no stamp at all, as the activations of a run without layer numbers
    write_safetensors(saved, load_file(saved), metadata={**meta, **stamp} if stamp else None)
    before = tree_hash(staging)
    proc = run_cli("gptq", str(tiny_llama), str(dst), *TINY_CALIB, "--resume", check=False)
    one_error_line(proc, "cannot resume")
    assert tree_hash(staging) == before and not dst.exists()


# -- bad input: one line, nothing written, the source unchanged ------------------------------
def refused(args: list[str], needle: str, src: Path, dst: Path | None = None) -> str:
    before = tree_hash(src)
    line = one_error_line(run_cli(*args, check=False), needle)
    assert tree_hash(src) == before
    if dst is not None:
        assert not dst.exists()
        nothing_beside(dst)
    return line


def _edit_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_header_offsets_that_disagree_with_the_shape(src, tmp_path):
    def shrink(header):  # the shape still matches the config; the bytes do not
        header["model.layers.0.mlp.up_proj.weight"]["data_offsets"][1] -= 2

    _edit_header(src / "model.safetensors", shrink)
    dst = tmp_path / "out"
    refused(["gptq", str(src), str(dst), *RTN], "its offsets give", src, dst)


def test_weight_map_that_is_a_list(src, tmp_path):
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]}))
    dst = tmp_path / "out"
    refused(["gptq", str(src), str(dst), *RTN], "weight_map must map", src, dst)


@pytest.mark.parametrize("fault", ["missing", "corrupt", "auto_map"])
def test_tokenizer_missing_corrupt_or_naming_code(src, tmp_path, fault):
    if fault == "missing":
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (src / name).unlink(missing_ok=True)
    elif fault == "corrupt":
        (src / "tokenizer.json").write_text("{not json")
    else:
        _edit_json(src / "tokenizer_config.json",
                   lambda d: d.update(auto_map={"AutoTokenizer": ["tok.EvilTokenizer", None]}))
    dst = tmp_path / "out"
    refused(["gptq", str(src), str(dst), *TINY_CALIB], "tokenizer", src, dst)


def test_non_utf8_jsonl_calibration(tiny_llama, tmp_path):
    calib = tmp_path / "calib.jsonl"
    calib.write_bytes(b'{"text": "caf\xe9"}\n')
    dst = tmp_path / "out"
    refused(["gptq", str(tiny_llama), str(dst), *TINY_CALIB, "--calib", str(calib)], "not UTF-8",
            tiny_llama, dst)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_batch_size_below_one(tiny_llama, tmp_path, value):
    dst = tmp_path / "out"
    refused(["gptq", str(tiny_llama), str(dst), "--batch-size", value, "--no-eval"],
            "--batch-size must be >= 1", tiny_llama, dst)


def test_seqlen_beyond_the_models_context(tiny_llama, tiny_gptq, tmp_path):
    dst = tmp_path / "out"  # the tiny model's max_position_embeddings is 1024
    refused(["gptq", str(tiny_llama), str(dst), "--seqlen", "2048", "--no-eval"],
            "--seqlen 2048 is beyond the model's context of 1024", tiny_llama, dst)
    refused(["eval", str(tiny_gptq), "--reference", str(tiny_llama), "--seqlen", "2048"],
            "--seqlen 2048 is beyond", tiny_llama)


def test_integer_weights_are_refused(src, tmp_path):
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    dst = tmp_path / "out"
    refused(["gptq", str(src), str(dst), *RTN], f"tensor {name} is I8", src, dst)


def test_eval_refuses_a_model_with_nan_weights(src, tiny_llama, tmp_path):
    from .conftest import put_nan

    put_nan(src, "model.layers.0.mlp.up_proj.weight", (0, 0))
    out = tmp_path / "r.json"
    refused(["eval", str(src), "--reference", str(tiny_llama), "--windows", "1", "--prompts", "1",
             "--seqlen", "32", "--new-tokens", "2", "--output-json", str(out)], "NaN or Inf logits",
            src)
    assert not out.exists()


def test_head_group_errors_name_the_head_group_flag(tiny_llama, tmp_path):
    dst = tmp_path / "out"  # hidden 64: --head-group 128 does not divide the head
    refused(["gptq", str(tiny_llama), str(dst), *RTN, "--head-group", "128", "--strict-group"],
            "--head-group 128 does not divide", tiny_llama, dst)


def test_phone_settings_errors_name_only_real_flags(src, tmp_path):
    from cpu_quant.errors import CpuQuantError
    from cpu_quant.export.pipeline import PhoneExportSettings

    for field_name in ("calib_decode_tokens", "verify_len"):
        with pytest.raises(CpuQuantError) as exc:
            PhoneExportSettings(**{field_name: -1}).validate()
        assert f"PhoneExportSettings.{field_name}" in str(exc.value)
        assert "--" not in str(exc.value)
    dst = tmp_path / "out"
    refused(["export-phone", str(src), str(dst), "--calib-samples", "-1"],
            "--calib-samples must be >= 0", src, dst)


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.pop("intermediate_size"), "intermediate_size is missing"),
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be a positive"),
    (lambda c: c.update(hidden_size="64"), "hidden_size must be a positive"),
])
def test_export_phone_config_values(src, tmp_path, edit, needle):
    _edit_json(src / "config.json", edit)
    dst = tmp_path / "out"
    refused(["export-phone", str(src), str(dst), "--backend", "xnnpack"], needle, src, dst)


# -- convert and inspect: what verify rejects is never written -------------------------------
def _first(names, suffix: str) -> str:
    return next(n for n in sorted(names) if n.endswith(suffix))


def _scales_with_nan(q: Path) -> None:
    f = next(q.glob("*.safetensors"))
    tensors = load_file(f)
    name = _first(tensors, ".scales")
    s = tensors[name].clone()
    s.view(-1)[0] = float("nan")
    tensors[name] = s
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize("fault, needle", [
    ("group", "fails verify"),
    ("nan_scale", "a stored scale is NaN or Inf"),
    ("regex", "not a valid regex"),
    ("bits_type", "quantization_config.bits is '4'"),
    ("report_list", "not a JSON object"),
])
def test_convert_refuses_what_verify_rejects(tiny_gptq, tmp_path, fault, needle):
    q = Path(shutil.copytree(tiny_gptq, tmp_path / "q"))
    qcfg = lambda c: c["quantization_config"]  # noqa: E731
    if fault == "group":
        _edit_json(q / "config.json", lambda c: qcfg(c).update(group_size=64))
    elif fault == "nan_scale":
        _scales_with_nan(q)
    elif fault == "regex":
        _edit_json(q / "config.json", lambda c: qcfg(c).update(dynamic={"-:model.(": {}}))
    elif fault == "bits_type":
        _edit_json(q / "config.json", lambda c: qcfg(c).update(bits="4"))
    else:
        (q / "quantization_report.json").write_text("[1, 2]")
    dst = tmp_path / "out"
    refused(["convert", str(q), str(dst), "--to", "cpu_int4"], needle, q, dst)


@pytest.mark.parametrize("fault", ["bits_type", "report_types"])
def test_inspect_with_wrong_value_types(tiny_gptq, tmp_path, fault):
    q = Path(shutil.copytree(tiny_gptq, tmp_path / "q"))
    if fault == "bits_type":
        _edit_json(q / "config.json", lambda c: c["quantization_config"].update(bits=[4]))
        refused(["inspect", str(q)], "quantization_config.bits", q)
        return
    _edit_json(q / "quantization_report.json",
               lambda r: r.update(settings=[1], tensors=3, plan_notes=7))
    proc = run_cli("inspect", str(q), check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
