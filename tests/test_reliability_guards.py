"""Guards: never destroy or write into the source, never resume into another model, and bad
input ends in one ``error:`` line with nothing left at or beside the output."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

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
    proc = run_cli("eval", str(tiny_gptq), "--reference", str(tiny_llama), "--json", str(missing),
                   check=False)
    one_error_line(proc, "does not exist")
    assert "eval windows" not in proc.stderr  # refused before any window was scored
    proc = run_cli("eval", str(tiny_gptq), "--reference", str(tiny_llama), "--json",
                   str(tiny_gptq / "r.json"), check=False)
    one_error_line(proc, "inside the source")
    assert tree_hash(tiny_gptq) == before


@pytest.mark.parametrize("flag", ["--prompts", "--windows"])
def test_eval_refuses_zero_prompts_or_windows(tiny_llama, tiny_gptq, flag):
    proc = run_cli("eval", str(tiny_gptq), "--reference", str(tiny_llama), flag, "0", check=False)
    one_error_line(proc, flag)
