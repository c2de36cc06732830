"""Bad input: a clear one-line error, a non-zero exit, and no output directory left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import put_nan, run_cli


def _assert_clean_failure(proc, dst: Path, needle: str) -> None:
    assert proc.returncode != 0
    err_lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(err_lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert needle in err_lines[0], err_lines[0]
    assert not dst.exists()
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]
    assert not leftovers, leftovers


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_source_directory(tmp_path):
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(tmp_path / "nope"), str(dst), "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "does not exist")


def test_directory_without_safetensors(tmp_path, tiny_llama):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(tiny_llama / "config.json", src / "config.json")
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(src), str(dst), "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "no .safetensors")


def test_pickle_checkpoint_is_refused(tmp_path, tiny_llama):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(tiny_llama / "config.json", src / "config.json")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(src), str(dst), "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "never unpickles")


def test_nan_weights(tmp_path, tiny_llama):
    src = _copy_model(tiny_llama, tmp_path / "src")
    put_nan(src, "model.layers.1.mlp.up_proj.weight", (3, 5))
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(src), str(dst), "--samples", "2", "--seqlen", "32", "--no-eval",
                   check=False)
    _assert_clean_failure(proc, dst, "NaN")


def test_truncated_safetensors(tmp_path, tiny_llama):
    src = _copy_model(tiny_llama, tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(src), str(dst), "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "truncated")


def test_config_that_disagrees_with_tensors(tmp_path, tiny_llama):
    src = _copy_model(tiny_llama, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (src / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(src), str(dst), "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "config disagrees with the tensors")


@pytest.mark.parametrize("content", ["", "Too short."])
def test_empty_or_too_short_calibration_text(tmp_path, tiny_llama, content):
    calib = tmp_path / "calib.txt"
    calib.write_text(content)
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(tiny_llama), str(dst), "--calib", str(calib), "--seqlen", "64",
                   "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "calibration text is too short")


def test_missing_calibration_file(tmp_path, tiny_llama):
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(tiny_llama), str(dst), "--calib", str(tmp_path / "none.txt"),
                   "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "does not exist")


def test_existing_output_without_overwrite(tmp_path, tiny_llama):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    proc = run_cli("gptq", str(tiny_llama), str(dst), "--no-eval", check=False)
    assert proc.returncode != 0 and "already exists" in proc.stderr
    assert (dst / "keep.txt").read_text() == "mine"


def test_group_not_accepted_by_vllm(tmp_path, tiny_llama):
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(tiny_llama), str(dst), "--group", "96", "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "--group must be one of")


def test_strict_group_refuses_non_dividing_group(tmp_path, tiny_llama):
    dst = tmp_path / "out"  # tiny model: hidden 64, so group 128 does not divide it
    proc = run_cli("gptq", str(tiny_llama), str(dst), "--group", "128", "--strict-group",
                   "--samples", "2", "--seqlen", "32", "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "--strict-group")


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_jsonl_calibration_and_directory(tmp_path, tiny_llama):
    from cpu_quant.data.corpus import builtin_split

    text = builtin_split("calibration")[0][:20000]
    d = tmp_path / "calib"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in text.split("\n\n")))
    (d / "b.txt").write_text(text)
    dst = tmp_path / "out"
    run_cli("gptq", str(tiny_llama), str(dst), "--calib", str(d), "--samples", "4", "--seqlen", "64",
            "--no-eval")
    report = json.loads((dst / "quantization_report.json").read_text())
    assert report["calibration_tokens"] == 4 * 64
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "wrong field"}\n')
    dst2 = tmp_path / "out2"
    proc = run_cli("gptq", str(tiny_llama), str(dst2), "--calib", str(bad), "--no-eval", check=False)
    _assert_clean_failure(proc, dst2, "field 'text'")


def test_config_link_pointing_outside_is_refused(tmp_path, tiny_llama):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(tiny_llama / "model.safetensors", src / "model.safetensors")
    outside = tmp_path / "elsewhere.json"
    shutil.copy(tiny_llama / "config.json", outside)
    (src / "config.json").symlink_to(outside)
    dst = tmp_path / "out"
    proc = run_cli("gptq", str(src), str(dst), "--no-eval", check=False)
    _assert_clean_failure(proc, dst, "points outside the checkpoint directory")


def test_hub_snapshot_links_into_blobs_are_accepted(tmp_path, tiny_llama):
    from cpu_quant.io.checkpoint import open_checkpoint

    repo = tmp_path / "models--x--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in tiny_llama.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    assert "model.embed_tokens.weight" in open_checkpoint(snap).names


@pytest.mark.parametrize("which", ["quant", "reference"])
def test_eval_of_missing_directories(tmp_path, tiny_llama, which):
    quant = tmp_path / "nope" if which == "quant" else tiny_llama
    reference = tmp_path / "nope" if which == "reference" else tiny_llama
    json_out = tmp_path / "report.json"
    proc = run_cli("eval", str(quant), "--reference", str(reference), "--output-json", str(json_out),
                   check=False)
    _assert_clean_failure(proc, json_out, "is not a directory")
