"""An artifact's digest names its weights: tensors and ``config.json``, nothing a run adds.

Two runs that write the same weights write different ``quantization_report.json`` files (their
timings differ), so a digest over every file would tell identical weights apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import provenance


def _artifact(root: Path, tensor: bytes = b"\x01\x02\x03\x04", report_seconds: float = 1.0
              ) -> Path:
    root.mkdir(parents=True)
    (root / "model-00001-of-00002.safetensors").write_bytes(tensor)
    (root / "model-00002-of-00002.safetensors").write_bytes(b"head")
    (root / "config.json").write_text(json.dumps({"quantization_config": {"bits": 4}}))
    (root / "quantization_report.json").write_text(json.dumps({"seconds": report_seconds}))
    (root / "tokenizer.json").write_text("{}")
    return root


def test_identical_weights_with_different_reports_hash_equal(tmp_path):
    a = provenance.artifact_digest(_artifact(tmp_path / "a", report_seconds=171.2))
    b = provenance.artifact_digest(_artifact(tmp_path / "b", report_seconds=154.2))
    assert a["sha256"] == b["sha256"]
    assert a["files"] == 3  # two shards and config.json
    assert a["bytes"] == b["bytes"]


def test_one_changed_tensor_byte_changes_the_digest(tmp_path):
    a = provenance.artifact_digest(_artifact(tmp_path / "a", tensor=b"\x01\x02\x03\x04"))
    b = provenance.artifact_digest(_artifact(tmp_path / "b", tensor=b"\x01\x02\x03\x05"))
    assert a["sha256"] != b["sha256"]


def test_a_changed_config_changes_the_digest(tmp_path):
    a = provenance.artifact_digest(_artifact(tmp_path / "a"))
    (tmp_path / "a" / "config.json").write_text(json.dumps({"quantization_config": {"bits": 8}}))
    assert provenance.artifact_digest(tmp_path / "a")["sha256"] != a["sha256"]


def test_a_file_artifact_is_hashed_whole(tmp_path):
    f = tmp_path / "model.pte"
    f.write_bytes(b"program")
    before = provenance.artifact_digest(f)
    f.write_bytes(b"programme")
    assert provenance.artifact_digest(f)["sha256"] != before["sha256"]


def test_a_directory_without_weights_or_a_missing_path_is_refused(tmp_path):
    (tmp_path / "quantization_report.json").write_text("{}")
    with pytest.raises(provenance.ProvenanceError, match="no tensor file"):
        provenance.artifact_digest(tmp_path)
    with pytest.raises(provenance.ProvenanceError, match="does not exist"):
        provenance.artifact_digest(tmp_path / "missing")


def test_the_fidelity_suite_records_the_weights_it_scored(tmp_path):
    from benchmarks.harness import PassContext
    from benchmarks.suites import fidelity, quantize

    spec = next(a for a in fidelity.ARMS if a.name == "gptq")
    scored = _artifact(tmp_path / "prebuilt")
    ctx = PassContext("gptq", 0, 0, tmp_path / "work", None, True)
    for prebuilt, expected in ((scored, scored), (None, tmp_path / "build" / "artifact")):
        arm = fidelity.cpu_quant_fidelity_arm(spec, tmp_path / "src", dict(quantize.SMOKE),
                                              dict(fidelity.EVAL_SMOKE), 60.0, prebuilt)
        build_ctx = PassContext("gptq", 0, 0, tmp_path / "work", tmp_path / "build", True)
        assert arm.artifacts(ctx if prebuilt else build_ctx) == {"artifact": expected}
    assert provenance.artifact_digest(scored)["files"] == 3
