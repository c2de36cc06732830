"""Guards that are not a refusal: what ``--overwrite`` may replace, when eval checks its output,
a resume across the resume point's write window, and what a summary shows of a damaged report.
(The refusals, one case per fault and command, are the hostile-input corpus:
tests/hostile/generate.py, tests/test_hostile_corpus.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .hostile.generate import TINY_SETTINGS, Bases, edit_json, invoke, tree_digest


def nothing_beside(dst: Path) -> None:
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]
    assert not leftovers, leftovers


def ok(argv: list) -> str:
    out = invoke(argv)
    assert out.exit_code == 0 and not out.traceback, out.stderr[-3000:] + repr(out.exception)
    return out.stdout


def test_overwrite_replaces_an_artifact_or_an_empty_directory_leaving_nothing_beside(
        hostile_bases: Bases, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()  # empty: replaceable
    gptq = hostile_bases.quant / "gptq"
    ok(["convert", gptq, dst, "--to", "cpu_int4", "--overwrite"])
    nothing_beside(dst)
    (dst / "stale.txt").write_text("old")  # an artifact: replaced whole
    ok(["convert", gptq, dst, "--to", "cpu_int4", "--overwrite"])
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] \
        == "cpu_int4"
    assert not (dst / "stale.txt").exists()
    nothing_beside(dst)


def test_eval_output_is_checked_before_the_evaluation(hostile_bases: Bases, tmp_path):
    """A refused --output-json or --save-reference costs nothing: no window was scored."""
    for flag in ("--output-json", "--save-reference"):
        out = invoke(["eval", hostile_bases.quant / "gptq", "--reference", hostile_bases.model,
                      flag, tmp_path / "no-such-dir" / "r.json"])
        assert out.exit_code == 2 and "does not exist" in out.stderr, out.stderr[-2000:]
        assert "windows" not in out.stderr and "loading" not in out.stderr, out.stderr[-2000:]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_resume_after_a_kill_between_the_activations_and_the_state(hostile_bases: Bases,
                                                                     tmp_path):
    """The activations of layer 2 are in place, the state still says layer 1 (a kill between
    the two writes): the resume uses layer 1's activations, kept until the state moved on, and
    gives the uninterrupted run's artifact bit for bit."""
    from cpu_quant.core.io.safetensors_writer import write_safetensors
    from cpu_quant.quantize.pipeline import quantize_checkpoint
    from cpu_quant.quantize.settings import QuantSettings

    settings = QuantSettings(**TINY_SETTINGS, calib=str(hostile_bases.calib), smooth=None)
    quantize_checkpoint(hostile_bases.model, tmp_path / "whole", settings, progress=False)
    dst = tmp_path / "out"
    staging = Path(shutil.copytree(hostile_bases.partial / ".out.partial",
                                   tmp_path / ".out.partial"))
    saved = staging / "cpu_quant_hidden-00001.safetensors"
    with safe_open(str(saved), framework="pt") as fh:
        meta = fh.metadata()
    ahead = {k: v + 1 for k, v in load_file(saved).items()}  # not layer 1's: must not be used
    write_safetensors(staging / "cpu_quant_hidden-00002.safetensors", ahead,
                      metadata={**meta, "completed_layers": "2"})
    ok(["gptq", hostile_bases.model, dst, "--group", "32", "--samples", "2", "--seqlen", "32",
        "--batch-size", "1", "--no-eval", "--calib", hostile_bases.calib, "--resume"])
    whole, resumed = _tensors(tmp_path / "whole"), _tensors(dst)
    assert sorted(whole) == sorted(resumed)
    for name, t in whole.items():
        assert torch.equal(t, resumed[name]), name
    nothing_beside(dst)


def test_a_refused_resume_is_refused_before_the_smoothing_pass(hostile_bases: Bases, tmp_path,
                                                              monkeypatch):
    """A resume with other settings, and one whose state file is damaged, stop with the resume's
    own line before the smoothing pass (the statistics forward and the choice of strengths: the
    longest step before the layers), and leave the interrupted run as it was."""
    from cpu_quant.quantize import smooth_fold

    def no_smoothing(*args, **kwargs):
        raise AssertionError("the smoothing pass ran before the resume was refused")

    monkeypatch.setattr(smooth_fold, "plan_smoothing", no_smoothing)
    staging = Path(shutil.copytree(hostile_bases.partial / ".out.partial",
                                   tmp_path / ".out.partial"))
    before = tree_digest(staging)
    argv = ["gptq", hostile_bases.model, tmp_path / "out", "--group", "32", "--seqlen", "32",
            "--batch-size", "1", "--no-eval", "--calib", hostile_bases.calib, "--resume"]
    out = invoke([*argv, "--samples", "3"])
    assert out.exit_code != 0 and not out.traceback, out.stderr[-2000:] + repr(out.exception)
    assert "cannot resume: the settings, formats or compute dtype" in out.stderr, out.stderr
    assert tree_digest(staging) == before
    (staging / "cpu_quant_state.json").write_text("{")
    out = invoke([*argv, "--samples", "2"])
    assert out.exit_code != 0 and not out.traceback, out.stderr[-2000:] + repr(out.exception)
    assert "is corrupted; run without --resume" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


def test_phone_settings_errors_name_only_real_flags():
    """Settings only the Python API sets are named as fields, never as flags that do not exist
    (the flags' own errors are in the corpus)."""
    from cpu_quant.core.errors import CpuQuantError
    from cpu_quant.export.pipeline import PhoneExportSettings

    for field_name in ("calib_decode_tokens", "verify_len"):
        with pytest.raises(CpuQuantError) as exc:
            PhoneExportSettings(**{field_name: -1}).validate()
        assert f"PhoneExportSettings.{field_name}" in str(exc.value)
        assert "--" not in str(exc.value)


def test_inspect_shows_what_it_can_of_a_report_with_wrong_value_types(hostile_bases: Bases,
                                                                        tmp_path):
    q = Path(shutil.copytree(hostile_bases.quant / "gptq", tmp_path / "q"))
    edit_json(q / "quantization_report.json",
              lambda r: r.update(settings=[1], tensors=3, plan_notes=7))
    before = tree_digest(q)
    assert "format" in ok(["inspect", q])
    assert tree_digest(q) == before


def test_ctrl_c_in_convert_leaves_nothing(hostile_bases: Bases, tmp_path, monkeypatch):
    """convert has no --resume: a Ctrl-C (or SIGTERM) removes its staging directory and lock
    and says so, instead of keeping a partial run nothing can continue."""
    from cpu_quant import convert

    def interrupt(out) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_refuse_unverified", interrupt)  # after every shard is written
    dst = tmp_path / "out"
    out = invoke(["convert", hostile_bases.quant / "gptq", dst, "--to", "cpu_int4"])
    assert out.exit_code == 130 and not out.traceback, out.stderr[-2000:]
    assert len(out.error_lines) == 1 and "convert interrupted; nothing was written" \
        in out.error_lines[0], out.stderr
    assert not dst.exists()
    nothing_beside(dst)
