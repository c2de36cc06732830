"""Input that looks unusual but is good: accepted. (Bad input, one case per fault and command,
is the hostile-input corpus: tests/hostile/generate.py, tests/test_hostile_corpus.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import run_cli


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
